#include "handlers.h"

namespace ffi = xla::ffi;

namespace sifar {

const char* AlgorithmName(int algorithm) {
  static const char* names[kNumAlgorithms] = {"oneshot", "twoshot",   "oneshot_db", "sifar_flag",
                                              "sifar",   "multicast", "sifar_push"};
  return (algorithm >= 0 && algorithm < kNumAlgorithms) ? names[algorithm] : "unknown";
}

std::string DescribeFailure(const Comm& comm) {
  ErrorRecord e;
  int group = 0;
  if (!comm.FirstError(&e, &group)) return "";
  std::string who = e.peer >= 0 ? "rank " + std::to_string(e.peer) : "a peer";
  return "sifar_jax: all-reduce timed out on axis '" + comm.axis_name() + "' (communicator " +
         std::to_string(comm.id()) + ", group " + std::to_string(group) + ", rank " +
         std::to_string(e.rank) + ", epoch " + std::to_string(e.epoch) + ", block " +
         std::to_string(e.block) + ", algorithm " + AlgorithmName(e.algorithm) + "): " + who +
         " never arrived within the timeout. The communicator is now failed: call "
         "sifar_jax.shutdown() and sifar_jax.init(mesh) again.";
}

ffi::Error FailedError(const Comm& comm) {
  std::string msg = DescribeFailure(comm);
  if (msg.empty()) msg = "sifar_jax: communicator " + std::to_string(comm.id()) + " has failed";
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
}

ffi::Error NotInitialisedError(int axis_key, int ordinal) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "sifar_jax: device " + std::to_string(ordinal) +
                        " has no communicator for this axis (key " + std::to_string(axis_key) +
                        "); call sifar_jax.init(mesh) before running, and do not call "
                        "sifar_jax.shutdown() while computations that use it can run");
}

ffi::Error CheckPayload(const Comm& comm, int nranks, size_t in_bytes, size_t out_bytes) {
  if (nranks != comm.nranks())
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sifar_jax: this computation was traced for an axis of " +
                          std::to_string(nranks) + " devices, but the communicator of axis '" +
                          comm.axis_name() + "' now has " + std::to_string(comm.nranks()) +
                          " ranks (sifar_jax.init was called again with another mesh); "
                          "re-trace the function");
  if (in_bytes != out_bytes)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "sifar_jax: output size mismatch");
  if (in_bytes % 16 != 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sifar_jax: payload must be a multiple of 16 bytes (sifar_psum pads it)");
  if (in_bytes > comm.slot_bytes())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sifar_jax: payload of " + std::to_string(in_bytes) +
                          " bytes exceeds the slot of " + std::to_string(comm.slot_bytes()) +
                          " bytes");
  return ffi::Error::Success();
}

ffi::Error ResolveBuffer(const Comm& comm, int group, int rank, const void* buf,
                         size_t buf_bytes, char* (&slots)[kMaxRanks], bool in_run_order) {
  if (buf_bytes < comm.slot_total_bytes())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sifar_jax.sifar_psum_into: the buffer is smaller than a slot; make it "
                      "with sifar_jax.make_buffers");
  std::string why;
  if (!comm.FindBuffer(group, rank, buf, slots, &why, in_run_order))
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
  return ffi::Error::Success();
}

}  // namespace sifar
