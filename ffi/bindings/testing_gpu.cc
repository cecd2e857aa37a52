// `sifar_jax._testing.VirtualRanks` (CUDA builds): N ranks of one
// communicator on ONE GPU, for the N > 2 tests where no N-GPU host exists.
// Each rank has its own workspace on that device and its own stream; every
// call goes through LaunchRankAllReduce (or LaunchRankFused for
// psum_add_rmsnorm), the CUDA handlers' own launch paths.
// Grids are kept small enough that all N ranks' blocks are resident at once
// (a spinning block whose peer cannot be scheduled would only time out).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "allreduce/launch.h"
#include "allreduce/plan.h"
#include "core/cuda_check.h"
#include "core/protocol.h"
#include "fused/fused.h"
#include "fused/launch.h"
#include "runtime/comm.h"

namespace nb = nanobind;

namespace sifar {
namespace {

constexpr int kHarnessAxisKey = -1;  // never a Python axis: its own pool entries
constexpr uint32_t kHarnessChain = 1;
constexpr int kThreadsPerBlock = 256;  // cuda::kThreads (the kernels' block size)

class VirtualRanks {
 public:
  VirtualRanks(int ordinal, int nranks, size_t slot_bytes, double timeout_s)
      : ordinal_(ordinal), nranks_(nranks) {
    if (nranks < 2 || nranks > kMaxRanks)
      throw std::invalid_argument("VirtualRanks: nranks must be 2.." + std::to_string(kMaxRanks));
    OnDevice on(ordinal_);
    SIFAR_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, ordinal_));
    comm_ = std::make_shared<Comm>(-1, Platform::kCuda, kHarnessAxisKey, "virtual",
                                   std::vector<std::vector<int>>{std::vector<int>(nranks, ordinal)},
                                   slot_bytes, timeout_s, /*lanes=*/1);
    for (int r = 0; r < nranks_; ++r) {
      cudaStream_t s = nullptr;
      SIFAR_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams_.push_back(s);
    }
  }
  ~VirtualRanks() { Close(); }

  void Close() {
    if (!comm_) return;
    {
      OnDevice on(ordinal_);
      for (cudaStream_t s : streams_) cudaStreamDestroy(s);
      if (in_) cudaFree(in_);
      if (out_) cudaFree(out_);
      cudaGetLastError();
    }
    streams_.clear();
    in_ = out_ = nullptr;
    capacity_ = 0;
    comm_.reset();  // waits for the device, pools the workspaces
  }

  // The largest payload whose grid keeps every rank's blocks resident: N
  // grids of at most one block per SM in total.
  size_t MaxBytes(int algorithm) const {
    if (!ValidAlgorithm(algorithm)) throw std::invalid_argument("VirtualRanks: unknown algorithm");
    const int blocks = std::max(1, std::min(kMaxBlocks, sms_ / nranks_));
    const size_t bytes = static_cast<size_t>(blocks) * kThreadsPerBlock * LineBytes(algorithm);
    return std::min(bytes, comm_->slot_bytes()) / 16 * 16;
  }

  void SetSkew(uint32_t max_ns, uint32_t seed) { Live().SetSkew(max_ns, seed); }

  // `iterations` all-reduces of `nbytes` per rank, launched back to back on
  // every rank's stream (rank r's call k waits on nothing but its peers), then
  // one synchronisation.  inputs/outputs: [iteration][rank][nbytes].
  // Returns (outputs, failure description or "", calls, retries, timeouts)
  // with the stats counted during this run for `algorithm`.
  std::tuple<nb::bytes, std::string, uint64_t, uint64_t, uint64_t> Run(
      int algorithm, int elem, nb::bytes inputs, size_t nbytes, int iterations) {
    Comm& comm = Live();
    if (!ValidAlgorithm(algorithm) || algorithm == kMulticast)
      throw std::invalid_argument("VirtualRanks: algorithm must be a portable one");
    if (elem < 0 || elem >= kNumElems) throw std::invalid_argument("VirtualRanks: bad element type");
    if (nbytes == 0 || nbytes % 16 != 0 || nbytes > MaxBytes(algorithm))
      throw std::invalid_argument("VirtualRanks: nbytes must be a positive multiple of 16, at most " +
                                  std::to_string(MaxBytes(algorithm)));
    if (iterations < 1 || static_cast<size_t>(iterations) * nranks_ > 1024)
      throw std::invalid_argument("VirtualRanks: iterations x nranks must be 1..1024 (launch queue)");
    const size_t total = static_cast<size_t>(iterations) * nranks_ * nbytes;
    if (inputs.size() != total) throw std::invalid_argument("VirtualRanks: inputs have the wrong size");
    std::vector<char> out(total);
    const auto before = comm.Stats();
    {
      nb::gil_scoped_release release;
      OnDevice on(ordinal_);
      Reserve(total);
      SIFAR_CUDA_CHECK(cudaMemcpy(in_, inputs.c_str(), total, cudaMemcpyHostToDevice));
      SIFAR_CUDA_CHECK(cudaMemset(out_, 0xff, total));  // NaN / -1: an unwritten line cannot pass
      SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
      for (int k = 0; k < iterations; ++k)
        for (int r = 0; r < nranks_; ++r) {
          const size_t at = (static_cast<size_t>(k) * nranks_ + r) * nbytes;
          RankCall c = HarnessCall(comm, r, elem, algorithm, at, nbytes);
          SIFAR_CUDA_CHECK(LaunchRankAllReduce(c, streams_[r]));
        }
      for (cudaStream_t s : streams_) SIFAR_CUDA_CHECK(cudaStreamSynchronize(s));
      SIFAR_CUDA_CHECK(cudaMemcpy(out.data(), out_, total, cudaMemcpyDeviceToHost));
    }
    const auto after = comm.Stats();
    uint64_t d[kNumStats] = {};
    for (size_t r = 0; r < after.size(); ++r)
      for (int f = 0; f < kNumStats; ++f) d[f] += after[r][algorithm][f] - before[r][algorithm][f];
    return {nb::bytes(out.data(), out.size()), DescribeFailure(comm), d[kCalls], d[kRetries],
            d[kTimeouts]};
  }

  // Kernel-level timing: `samples` launches of every rank's kernel with
  // `repeat` all-reduces back to back inside it (no skew unless set), each
  // sample timed on the host from the first launch to the last stream's end.
  // (t(R) - t(1)) / (R - 1) over two such runs is one all-reduce's latency
  // inside a kernel, the launch cancelled.  Returns the samples' seconds.
  // The same harness builds against the tree before a change (tools/validate_ffi.sh).
  std::vector<double> TimeRepeated(int algorithm, int elem, size_t nbytes, int repeat, int samples) {
    Comm& comm = Live();
    if (!ValidAlgorithm(algorithm) || algorithm == kMulticast)
      throw std::invalid_argument("VirtualRanks: algorithm must be a portable one");
    if (elem < 0 || elem >= kNumElems) throw std::invalid_argument("VirtualRanks: bad element type");
    if (nbytes == 0 || nbytes % 16 != 0 || nbytes > MaxBytes(algorithm))
      throw std::invalid_argument("VirtualRanks: nbytes must be a positive multiple of 16, at most " +
                                  std::to_string(MaxBytes(algorithm)));
    if (repeat < 1 || samples < 1) throw std::invalid_argument("VirtualRanks: repeat, samples >= 1");
    std::vector<double> out;
    nb::gil_scoped_release release;
    OnDevice on(ordinal_);
    const size_t total = static_cast<size_t>(nranks_) * nbytes;
    Reserve(total);
    SIFAR_CUDA_CHECK(cudaMemset(in_, 0, total));  // zeros: every sum exact, never NaN
    SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
    for (int k = 0; k < samples; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < nranks_; ++r) {
        RankCall c = HarnessCall(comm, r, elem, algorithm, static_cast<size_t>(r) * nbytes, nbytes);
        c.repeat = repeat;
        SIFAR_CUDA_CHECK(LaunchRankAllReduce(c, streams_[r]));
      }
      for (cudaStream_t s : streams_) SIFAR_CUDA_CHECK(cudaStreamSynchronize(s));
      out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    if (!DescribeFailure(comm).empty()) throw std::runtime_error(DescribeFailure(comm));
    return out;
  }

  // TimeRepeated for psum_add_rmsnorm's kernel: `rows` rows of `hidden`
  // zeros per rank (as RunFused lays them out), `repeat` fused calls per launch.
  std::vector<double> TimeFusedRepeated(int elem, size_t hidden, size_t rows, int repeat,
                                        int samples) {
    Comm& comm = Live();
    if (elem != static_cast<int>(Elem::kF32) && elem != static_cast<int>(Elem::kBf16) &&
        elem != static_cast<int>(Elem::kF16))
      throw std::invalid_argument("VirtualRanks: psum_add_rmsnorm takes float32, bfloat16, float16");
    const size_t esize = elem == static_cast<int>(Elem::kF32) ? 4 : 2;
    FusedCall fused;
    fused.hidden = hidden;
    fused.row_bytes = hidden * esize;
    fused.padded_row_bytes = FusedPaddedRowBytes(fused.row_bytes);
    fused.row_blocks = FusedRowBlocks(fused.row_bytes);
    fused.eps = 1e-6f;
    const size_t nbytes = rows * fused.row_bytes;
    if (rows == 0 || fused.row_blocks == 0 || rows * fused.padded_row_bytes > comm.slot_bytes())
      throw std::invalid_argument("VirtualRanks: rows the fused kernel does not hold in the slot");
    const int blocks = BlocksFor(rows * fused.padded_row_bytes / 8, kThreadsPerBlock);
    if (blocks / FusedBlocksPerThreadBlock(fused.row_blocks) * nranks_ > sms_)
      throw std::invalid_argument("VirtualRanks: the ranks' thread blocks exceed the SMs");
    if (repeat < 1 || samples < 1) throw std::invalid_argument("VirtualRanks: repeat, samples >= 1");
    std::vector<double> out;
    nb::gil_scoped_release release;
    OnDevice on(ordinal_);
    const size_t total = static_cast<size_t>(nranks_) * nbytes;
    Reserve(2 * total + nbytes + fused.row_bytes);  // x, residual, weight | new_residual, normed
    SIFAR_CUDA_CHECK(cudaMemset(in_, 0, 2 * total + nbytes + fused.row_bytes));
    SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
    fused.residual = in_ + total;
    fused.weight = in_ + total + nbytes;
    for (int k = 0; k < samples; ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < nranks_; ++r) {
        const size_t at = static_cast<size_t>(r) * nbytes;
        RankCall c = HarnessCall(comm, r, elem, kSifar, at, nbytes);
        c.repeat = repeat;
        FusedCall f = fused;
        f.normed = out_ + total + at;
        FusedLaunch shape;
        SIFAR_CUDA_CHECK(LaunchRankFused(c, f, streams_[r], shape));
      }
      for (cudaStream_t s : streams_) SIFAR_CUDA_CHECK(cudaStreamSynchronize(s));
      out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    if (!DescribeFailure(comm).empty()) throw std::runtime_error(DescribeFailure(comm));
    return out;
  }

  // psum_add_rmsnorm's kernel: `iterations` fused calls of `rows` rows of
  // `hidden` elements per rank, launched as Run launches.  x: [iteration][rank]
  // [rows * hidden]; residual ([rows * hidden]) and weight ([hidden]) the same
  // for every rank and iteration.  Returns (normed, new_residual) as
  // [iteration][rank][rows * hidden], then Run's failure and stats (sifar's).
  std::tuple<nb::bytes, nb::bytes, std::string, uint64_t, uint64_t, uint64_t> RunFused(
      int elem, nb::bytes x, nb::bytes residual, nb::bytes weight, size_t hidden, size_t rows,
      float eps, int iterations) {
    Comm& comm = Live();
    if (elem != static_cast<int>(Elem::kF32) && elem != static_cast<int>(Elem::kBf16) &&
        elem != static_cast<int>(Elem::kF16))
      throw std::invalid_argument("VirtualRanks: psum_add_rmsnorm takes float32, bfloat16, float16");
    const size_t esize = elem == static_cast<int>(Elem::kF32) ? 4 : 2;
    FusedCall fused;
    fused.hidden = hidden;
    fused.row_bytes = hidden * esize;
    fused.padded_row_bytes = FusedPaddedRowBytes(fused.row_bytes);
    fused.row_blocks = FusedRowBlocks(fused.row_bytes);
    fused.eps = eps;
    const size_t nbytes = rows * fused.row_bytes;
    if (rows == 0 || fused.row_blocks == 0)
      throw std::invalid_argument("VirtualRanks: rows the fused kernel does not hold");
    if (rows * fused.padded_row_bytes > comm.slot_bytes())
      throw std::invalid_argument("VirtualRanks: the padded rows exceed the slot");
    // Every rank's thread blocks resident together (at most one per SM in total).
    const int blocks = BlocksFor(rows * fused.padded_row_bytes / 8, kThreadsPerBlock);
    const int thread_blocks = blocks / FusedBlocksPerThreadBlock(fused.row_blocks);
    if (thread_blocks * nranks_ > sms_)
      throw std::invalid_argument("VirtualRanks: " + std::to_string(nranks_) + " ranks of " +
                                  std::to_string(thread_blocks) + " thread blocks exceed " +
                                  std::to_string(sms_) + " SMs");
    if (iterations < 1 || static_cast<size_t>(iterations) * nranks_ > 1024)
      throw std::invalid_argument("VirtualRanks: iterations x nranks must be 1..1024 (launch queue)");
    const size_t total = static_cast<size_t>(iterations) * nranks_ * nbytes;
    if (x.size() != total || residual.size() != nbytes || weight.size() != fused.row_bytes)
      throw std::invalid_argument("VirtualRanks: x, residual or weight has the wrong size");
    std::vector<char> normed(total), new_residual(total);
    const auto before = comm.Stats();
    {
      nb::gil_scoped_release release;
      OnDevice on(ordinal_);
      // in_: x, then residual and weight; out_: new_residual, then normed.
      Reserve(2 * total + nbytes + fused.row_bytes);
      char* res = in_ + total;
      char* w = res + nbytes;
      SIFAR_CUDA_CHECK(cudaMemcpy(in_, x.c_str(), total, cudaMemcpyHostToDevice));
      SIFAR_CUDA_CHECK(cudaMemcpy(res, residual.c_str(), nbytes, cudaMemcpyHostToDevice));
      SIFAR_CUDA_CHECK(cudaMemcpy(w, weight.c_str(), fused.row_bytes, cudaMemcpyHostToDevice));
      SIFAR_CUDA_CHECK(cudaMemset(out_, 0xff, 2 * total));  // NaN: an unwritten line cannot pass
      SIFAR_CUDA_CHECK(cudaDeviceSynchronize());
      fused.residual = res;
      fused.weight = w;
      for (int k = 0; k < iterations; ++k)
        for (int r = 0; r < nranks_; ++r) {
          const size_t at = (static_cast<size_t>(k) * nranks_ + r) * nbytes;
          RankCall c = HarnessCall(comm, r, elem, kSifar, at, nbytes);
          FusedCall f = fused;
          f.normed = out_ + total + at;
          FusedLaunch shape;
          SIFAR_CUDA_CHECK(LaunchRankFused(c, f, streams_[r], shape));
        }
      for (cudaStream_t s : streams_) SIFAR_CUDA_CHECK(cudaStreamSynchronize(s));
      SIFAR_CUDA_CHECK(cudaMemcpy(new_residual.data(), out_, total, cudaMemcpyDeviceToHost));
      SIFAR_CUDA_CHECK(cudaMemcpy(normed.data(), out_ + total, total, cudaMemcpyDeviceToHost));
    }
    const auto after = comm.Stats();
    uint64_t d[kNumStats] = {};
    for (size_t r = 0; r < after.size(); ++r)
      for (int f = 0; f < kNumStats; ++f) d[f] += after[r][kSifar][f] - before[r][kSifar][f];
    return {nb::bytes(normed.data(), normed.size()),
            nb::bytes(new_residual.data(), new_residual.size()), DescribeFailure(comm), d[kCalls],
            d[kRetries], d[kTimeouts]};
  }

 private:
  Comm& Live() {
    if (!comm_) throw std::runtime_error("VirtualRanks: closed");
    return *comm_;
  }
  // Rank r's call of the harness's chain on its slice [at, at + nbytes) of the buffers.
  RankCall HarnessCall(Comm& comm, int r, int elem, int algorithm, size_t at, size_t nbytes) {
    RankCall c;
    c.comm = &comm;
    c.group = 0;
    c.rank = r;
    c.elem = static_cast<Elem>(elem);
    c.algorithm = algorithm;
    c.repeat = 1;
    c.chain = kHarnessChain;
    c.lane_at = comm.layout().LaneAt(LaneOf(kHarnessChain, comm.layout().lanes));
    c.in = in_ + at;
    c.out = out_ + at;
    c.nbytes = nbytes;
    return c;
  }

  void Reserve(size_t bytes) {
    if (bytes <= capacity_) return;
    if (in_) cudaFree(in_);
    if (out_) cudaFree(out_);
    in_ = out_ = nullptr;
    capacity_ = 0;
    SIFAR_CUDA_CHECK(cudaMalloc(&in_, bytes));
    SIFAR_CUDA_CHECK(cudaMalloc(&out_, bytes));
    capacity_ = bytes;
  }

  int ordinal_, nranks_;
  int sms_ = 0;
  std::shared_ptr<Comm> comm_;
  std::vector<cudaStream_t> streams_;
  char* in_ = nullptr;
  char* out_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace

void RegisterGpuTestingBindings(nb::module_& t) {
  nb::class_<VirtualRanks>(t, "VirtualRanks",
                           "N ranks of one communicator on one GPU, each on its own stream")
      .def(nb::init<int, int, size_t, double>(), nb::arg("ordinal"), nb::arg("nranks"),
           nb::arg("slot_bytes"), nb::arg("timeout_s"))
      .def("max_bytes", &VirtualRanks::MaxBytes, nb::arg("algorithm"))
      .def("set_skew", &VirtualRanks::SetSkew, nb::arg("max_ns"), nb::arg("seed"))
      .def("run", &VirtualRanks::Run, nb::arg("algorithm"), nb::arg("elem"), nb::arg("inputs"),
           nb::arg("nbytes"), nb::arg("iterations"))
      .def("run_fused", &VirtualRanks::RunFused, nb::arg("elem"), nb::arg("x"),
           nb::arg("residual"), nb::arg("weight"), nb::arg("hidden"), nb::arg("rows"),
           nb::arg("eps"), nb::arg("iterations"))
      .def("time_repeated", &VirtualRanks::TimeRepeated, nb::arg("algorithm"), nb::arg("elem"),
           nb::arg("nbytes"), nb::arg("repeat"), nb::arg("samples"))
      .def("time_fused_repeated", &VirtualRanks::TimeFusedRepeated, nb::arg("elem"),
           nb::arg("hidden"), nb::arg("rows"), nb::arg("repeat"), nb::arg("samples"))
      .def("close", &VirtualRanks::Close);
}

}  // namespace sifar
