// NVLink multicast (redundant pull): the guard, the set-up arithmetic, and the
// CUDA entry points of algorithm "multicast".
//
// Every rank writes its partial into its own memory (a unicast mapping of its
// share of a multicast object) and then issues `multimem.ld_reduce` over the
// whole payload through the multicast mapping: the NVSwitch reads all N
// copies, reduces them (fp32 accumulation) and returns K bytes.  Dual-buffered
// slots remove the bottom barrier; a per-block flag (= epoch) reduced
// alongside the payload validates the speculative pull (the paper's scheme,
// flaw included: see cuda_multicast.cu).
//
// SAFETY.  Multicast can take a host's shared GPUs out of service.  Nothing
// here calls the CUDA driver before the guard (MulticastRefusal) has passed:
// SIFAR_ENABLE_MULTICAST=1, none of NCCL_NVLS_ENABLE=0 /
// NVSHMEM_DISABLE_NVLS=1 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1, and every
// device reporting CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED.  Every CUDA call
// the multicast code makes is counted (MulticastCounters) so tests can prove
// a refusal reached none.
//
// This header compiles without CUDA: the guard and the arithmetic are pure
// host code, shared with the kernel through SIFAR_HD functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/elem_type.h"
#include "core/protocol.h"

#ifdef SIFAR_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace sifar {

// ------------------------------------------------------------------ guard --
// Keep in sync with src/sifar_jax/multicast.py (a test compares them).
constexpr const char* kMulticastEnableVar = "SIFAR_ENABLE_MULTICAST";
struct DisablingVar {
  const char* name;
  const char* off;  // the value (after stripping whitespace) that means "multicast is off"
};
constexpr DisablingVar kMulticastDisabling[] = {
    {"NCCL_NVLS_ENABLE", "0"},
    {"NVSHMEM_DISABLE_NVLS", "1"},
    {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
};
constexpr int kNumMulticastDisabling = 3;

// Looks an environment variable up: nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;
EnvLookup ProcessEnv();  // getenv

// Device support as the guard sees it.
enum class DeviceSupport { kUnknown, kNo, kYes };

// Why multicast may not run, or nullopt if it may.  Pure: reads only `env`.
// The same rules and words as sifar_jax.multicast.refusal().
std::optional<std::string> MulticastRefusal(const EnvLookup& env, DeviceSupport devices);

// The guard as the set-up runs it: the process environment first; only when
// that allows multicast, the devices' CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
// (a read-only query; a CPU-only build refuses instead).
std::optional<std::string> MulticastRefusalHere(const std::vector<int>& ordinals);

// Thrown (before any CUDA call) when the guard refuses.
class MulticastRefused : public std::runtime_error {
 public:
  explicit MulticastRefused(const std::string& reason)
      : std::runtime_error("sifar_jax: algorithm 'multicast' refused: " + reason) {}
};

struct MulticastCounters {
  uint64_t cuda_calls;  // CUDA calls (driver or runtime) of the multicast set-up, queries,
                        // teardown and launches (not PreloadMulticastKernels)
  uint64_t refusals;    // guard refusals inside CreateMulticastGroup / MulticastRefusalHere
  uint64_t setups;      // CreateMulticastGroup calls that got past the guard
};
MulticastCounters GetMulticastCounters();
// Internal: bumped by the multicast code.
void CountMulticastCudaCall();
void CountMulticastRefusal();
void CountMulticastSetup();

// ------------------------------------------------------------- arithmetic --
// One 16-byte line per thread; a block owns lines as in protocol.h
// (BlockOfLine with this many lines per block), the same for every size.
// Equal to the portable kernels' block size (cuda::kThreads).
constexpr int kMulticastLinesPerBlock = 256;
// Per-block flag: the epoch, zero-extended to 64 bits so the reduced sum of N
// flags is exact (see MulticastFlagsValid).
using MulticastFlag = uint64_t;

// The layout of each device's share of the multicast object (the same on
// every device, so one offset addresses a rank's unicast copy and the
// multicast view alike):
//
//   slot[0], slot[1]   dual buffers, alternating with the epoch's parity
//     payload          slot_bytes, 16-byte lines
//     flags            kMaxBlocks MulticastFlag words, one per block
//   (padding up to the granularity)
struct MulticastLayout {
  size_t slot_bytes;   // payload capacity, a multiple of 16
  size_t slot0;        // offset of slot 0
  size_t slot_stride;  // slot 1 = slot0 + slot_stride
  size_t payload;      // payload region, inside a slot
  size_t flags;        // flag words, inside a slot
  size_t need;         // bytes the layout uses
  size_t granularity;  // what sizes and VA ranges are rounded to
  size_t alloc_bytes;  // multicast object size = each device's allocation = each VA range
  bool recommended;    // granularity follows the recommended (not minimum) multicast granularity
};

// Rounds up; `a` need not be a power of two.  Throws on overflow.
size_t RoundUpTo(size_t x, size_t a);
size_t Lcm(size_t a, size_t b);  // throws on overflow or zero

// The bytes the layout needs for `slot_bytes` of payload (before rounding).
size_t MulticastNeedBytes(size_t slot_bytes);

// Picks the granularity and lays the buffer out.  `mc_min` / `mc_rec`: the
// multicast object's minimum / recommended granularity
// (cuMulticastGetGranularity), `mem_gran`: the physical allocation's
// (cuMemGetAllocationGranularity).  Every size and offset handed to the
// driver is a multiple of lcm(mc_min, mem_gran); the recommended granularity
// is used unless it would more than double the allocation (it can be hundreds
// of MiB, for a buffer of a few KiB).  Throws std::invalid_argument.
MulticastLayout MakeMulticastLayout(size_t slot_bytes, size_t mc_min, size_t mc_rec,
                                    size_t mem_gran);

// Offsets inside one device's share, used by the kernel and tested on the host.
SIFAR_HD size_t MulticastSlotOffset(const MulticastLayout& m, uint32_t epoch) {
  return m.slot0 + SlotParity(epoch) * m.slot_stride;
}
SIFAR_HD size_t MulticastLineOffset(const MulticastLayout& m, uint32_t epoch, size_t line) {
  return MulticastSlotOffset(m, epoch) + m.payload + line * 16;
}
SIFAR_HD size_t MulticastFlagOffset(const MulticastLayout& m, uint32_t epoch, int block) {
  return MulticastSlotOffset(m, epoch) + m.flags + static_cast<size_t>(block) * sizeof(MulticastFlag);
}
// The speculative pull is valid iff every rank's flag for this (block, slot)
// is `epoch`.  A stale flag holds an older epoch of the same parity, and it is
// the same older epoch on every rank (all ranks run the same sequence of
// all-reduces and are never two apart), so with k fresh flags the sum is
// k*epoch + (N-k)*stale, which equals N*epoch only for k == N.  The sum is
// taken in 64 bits, so it is exact (a 32-bit sum could alias).
SIFAR_HD bool MulticastFlagsValid(uint64_t flag_sum, int nranks, uint32_t epoch) {
  return flag_sum == static_cast<uint64_t>(nranks) * epoch;
}
// Blocks of one all-reduce of `lines` 16-byte lines.
SIFAR_HD int MulticastBlocks(size_t lines) { return BlocksFor(lines, kMulticastLinesPerBlock); }
// The kernel's iteration: thread t of block b moves lines
// first, first + stride, ... (< lines).
SIFAR_HD size_t MulticastFirstLine(int block, int thread) {
  return static_cast<size_t>(block) * kMulticastLinesPerBlock + thread;
}
SIFAR_HD size_t MulticastLineStride() {
  return static_cast<size_t>(kMaxBlocks) * kMulticastLinesPerBlock;
}

// ------------------------------------------------------------------- CUDA --
// One multicast object per group of ranks: each device's physical memory is
// bound to it and mapped twice on that device, unicast (its own stores) and
// multicast (multimem.ld_reduce).  Destroying it unmaps and releases
// everything (the CUDA build's subclass does the driver work).
struct MulticastGroup {
  std::vector<int> ordinals;  // rank -> device ordinal
  MulticastLayout layout{};
  std::vector<char*> unicast;    // rank -> its own share, unicast VA (device pointer)
  std::vector<char*> multicast;  // rank -> the multicast VA mapped for that device
  virtual ~MulticastGroup() = default;
  int nranks() const { return static_cast<int>(ordinals.size()); }
};

// Runs the guard FIRST (throws MulticastRefused, having made no CUDA call),
// then builds the multicast object for `ordinals` (rank order) with room for
// `slot_bytes` of payload per slot.  Every CUDA failure throws
// std::runtime_error naming the call.  A build without CUDA throws after the
// guard.
std::unique_ptr<MulticastGroup> CreateMulticastGroup(const std::vector<int>& ordinals,
                                                     size_t slot_bytes);

// One launch of the multicast all-reduce on one rank.
struct MulticastCall {
  int rank = -1;
  int elem_type = static_cast<int>(Elem::kF32);  // Elem: f32, bf16 or f16
  const void* in = nullptr;
  void* out = nullptr;      // may alias `in`
  size_t bytes = 0;         // a multiple of 16, at most layout.slot_bytes
  int repeat = 1;           // back-to-back all-reduces in this launch
  char* workspaces[kMaxRanks] = {};  // every rank's workspace (P2P): epochs, stats, Control
  ErrorRecord* err = nullptr;        // this rank's failure record (the kernel's view)
  WorkspaceLayout layout{};
};

#ifdef SIFAR_WITH_CUDA
// Enqueues the kernel on `stream`; no host synchronisation, no host-side
// epoch (CUDA-graph safe).  cudaErrorInvalidValue for a bad call.
cudaError_t LaunchMulticastAllReduce(const MulticastGroup& group, const MulticastCall& call,
                                     cudaStream_t stream);
// Loads the multicast kernels on the current device (no multicast call).
cudaError_t PreloadMulticastKernels();
#endif

}  // namespace sifar
