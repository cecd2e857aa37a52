#include "allreduce/plan.h"

#include <cstring>

namespace ffi = xla::ffi;

namespace sifar {

bool ElemOf(ffi::DataType t, Elem* out) {
  switch (t) {
    case ffi::DataType::F32: *out = Elem::kF32; return true;
    case ffi::DataType::BF16: *out = Elem::kBf16; return true;
    case ffi::DataType::F16: *out = Elem::kF16; return true;
    case ffi::DataType::S32:
    case ffi::DataType::U32: *out = Elem::kU32; return true;
    default: return false;
  }
}

const char* const* SupportedDtypeNames() {
  static const char* names[] = {"float32", "bfloat16", "float16", "int32", "uint32", nullptr};
  return names;
}

const char* AlgorithmName(int algorithm) {
  return ValidAlgorithm(algorithm) ? kAlgorithms[algorithm].name : "unknown";
}

std::string DescribeFailure(const Comm& comm) {
  ErrorRecord e;
  int group = 0;
  if (!comm.FirstError(&e, &group)) return "";
  std::string who = e.peer >= 0 ? "rank " + std::to_string(e.peer) : "a peer";
  if (e.peer >= 0 && comm.ProcessOf(group, e.peer) >= 0)
    who += " (process " + std::to_string(comm.ProcessOf(group, e.peer)) + ")";
  return "sifar_jax: all-reduce timed out on axis '" + comm.axis_name() + "' (communicator " +
         std::to_string(comm.id()) + ", group " + std::to_string(group) + ", rank " +
         std::to_string(e.rank) + ", epoch " + std::to_string(e.epoch) + ", block " +
         std::to_string(e.block) + ", chain " + std::to_string(e.chain) + ", algorithm " +
         AlgorithmName(e.algorithm) + "): " + who +
         " never arrived within the timeout (or ran a different all-reduce: every rank must "
         "run the same all-reduces in the same order). The communicator is now failed: call "
         "sifar_jax.shutdown() and sifar_jax.init(mesh) again.";
}

ffi::Error FailedError(const Comm& comm) {
  std::string msg = DescribeFailure(comm);
  if (msg.empty() && comm.spans_processes())
    msg = "sifar_jax: communicator " + std::to_string(comm.id()) + " of axis '" +
          comm.axis_name() +
          "' failed in another process (its error names the rank that never arrived); call "
          "sifar_jax.shutdown() and sifar_jax.init(mesh) again in every process.";
  if (msg.empty()) msg = "sifar_jax: communicator " + std::to_string(comm.id()) + " has failed";
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, msg);
}

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "sifar_jax: " + msg);
}

namespace {

ffi::Error CheckPayload(const Comm& comm, int nranks, size_t in_bytes, size_t out_bytes) {
  if (nranks != comm.nranks())
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sifar_jax: this computation was traced for an axis of " +
                          std::to_string(nranks) + " devices, but the communicator of axis '" +
                          comm.axis_name() + "' now has " + std::to_string(comm.nranks()) +
                          " ranks (sifar_jax.init was called again with another mesh); "
                          "re-trace the function");
  if (in_bytes != out_bytes) return Invalid("output size mismatch");
  if (in_bytes % 16 != 0)
    return Invalid("payload must be a multiple of 16 bytes (sifar_psum pads it)");
  if (in_bytes > comm.slot_bytes())
    return Invalid("payload of " + std::to_string(in_bytes) + " bytes exceeds the slot of " +
                   std::to_string(comm.slot_bytes()) + " bytes");
  return ffi::Error::Success();
}

ffi::Error ResolveBuffer(const Comm& comm, int group, int rank, const void* buf, size_t buf_bytes,
                         char* (&slots)[kMaxRanks], bool in_run_order) {
  if (buf_bytes < comm.slot_total_bytes())
    return Invalid(
        "sifar_psum_into: the buffer is smaller than a slot; make it with "
        "sifar_jax.make_buffers");
  std::string why;
  if (!comm.FindBuffer(group, rank, buf, slots, &why, in_run_order))
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, why);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error PlanCall(int ordinal, ffi::AnyBuffer x, ffi::AnyBuffer y, const ffi::AnyBuffer* buf,
                    int32_t axis_key, int32_t nranks, int32_t algorithm, int32_t repeat,
                    int32_t chain, RankCall* call, bool in_run_order) {
  if (!ElemOf(x.element_type(), &call->elem))
    return Invalid("only float32, bfloat16, float16, int32 and uint32 are supported");
  if (!ValidAlgorithm(algorithm)) return Invalid("unknown algorithm id " + std::to_string(algorithm));
  RankRef ref = Registry::Get().Lookup(axis_key, ordinal);
  if (ref.comm == nullptr)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sifar_jax: device " + std::to_string(ordinal) +
                          " has no communicator for this axis (key " + std::to_string(axis_key) +
                          "); call sifar_jax.init(mesh) before running, and do not call "
                          "sifar_jax.shutdown() while computations that use it can run");
  Comm& comm = *ref.comm;
  ffi::Error err = CheckPayload(comm, nranks, x.size_bytes(), y.size_bytes());
  if (err.failure()) return err;
  // A failure seen by any rank of the group surfaces at the next call (when
  // XLA replays a command buffer this host code does not run: check() does).
  for (int r = 0; r < comm.nranks(); ++r)
    if (comm.RankFailed(ref.group, r)) return FailedError(comm);
  if (reinterpret_cast<uintptr_t>(x.untyped_data()) % 16 ||
      reinterpret_cast<uintptr_t>(y.untyped_data()) % 16)
    return Invalid("buffers must be 16-byte aligned");
  call->comm = &comm;
  call->hold = ref.comm;
  call->group = ref.group;
  call->rank = ref.rank;
  call->algorithm = algorithm;
  call->repeat = repeat < 1 ? 1 : repeat;
  call->chain = static_cast<uint32_t>(chain);
  call->lane_at = comm.layout().LaneAt(LaneOf(call->chain, comm.layout().lanes));
  call->in = x.untyped_data();
  call->out = y.untyped_data();
  call->nbytes = x.size_bytes();
  if (buf != nullptr) {
    if (algorithm == kMulticast)
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "sifar_jax: explicit buffers are not supported with multicast");
    call->explicit_buffers = true;
    return ResolveBuffer(comm, ref.group, ref.rank, buf->untyped_data(), buf->size_bytes(),
                         call->slots, in_run_order);
  }
  return ffi::Error::Success();
}

}  // namespace sifar
