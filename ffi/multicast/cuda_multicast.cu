// Algorithm "multicast" (redundant pull through NVLink multicast): the
// multicast object set-up and the multimem.ld_reduce kernel.
//
// IMPLEMENTED AND COMPILED, NEVER EXECUTED ON OUR HARDWARE.  Multicast is
// forbidden on our GPU hosts (docs/design.md, Multicast).  Nothing in this file
// calls the driver before the guard (MulticastRefusalHere) has passed, and
// every CUDA call is counted (CountMulticastCudaCall) so tests can prove a
// refusal made none.
//
// The driver API is reached only through cudaGetDriverEntryPointByVersion
// from the statically linked runtime: the module never links libcuda and
// imports where no CUDA is installed.  <cuda.h> is included for the types.
//
// Protocol, per block b of rank r at epoch e (slot = e % 2):
//   1. every thread stores its 16-byte lines of the input into r's own share
//      of slot[e%2] (unicast mapping); after a block barrier, thread 0
//      publishes flag[e%2][b] = e with a system-scope release;
//   2. speculative pull: thread 0 issues multimem.ld_reduce.add.u64 on the
//      flag while every thread issues multimem.ld_reduce.add (fp32
//      accumulation, 16-byte vectors) on its lines, all through the multicast
//      mapping: the NVSwitch returns the reduced line, K bytes instead of
//      K x (N-1);
//   3. the flags summing to N*e (MulticastFlagsValid) accepts the pull;
//      otherwise thread 0 re-reads the flag sum with acquire semantics until
//      it is N*e (bounded by a %globaltimer deadline) and the block pulls
//      again.
// Dual buffering removes the bottom barrier exactly as in the portable
// kernels: finishing e-1 proves every peer's block b started e-1, hence
// finished reading slot[e%2] at e-2.
//
// KNOWN FLAW (the paper's, kept on purpose; docs/design.md, What SiFAR is: Correct by construction): in step 2
// the flag and the payload loads are not ordered, so a pull can in principle
// see a stale payload together with a fresh flag.  The epoch-tagged "sifar"
// algorithm is the correct-by-construction default; an epoch tag cannot ride
// inside a line the switch sums, so this path cannot use it.  The result is
// what the NVSwitch returns: fp32 accumulation rounded once, in an order the
// PTX ISA does not specify (bit-identical across ranks only as far as the
// switch is deterministic).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "core/cuda_check.h"
#include "core/device.cuh"
#include "multicast/multicast.h"

namespace sifar {

// =========================================================== device code ==
namespace {

constexpr int kThreads = kMulticastLinesPerBlock;
static_assert(kThreads == cuda::kThreads, "one line-to-block ownership for all kernels");
constexpr int kBatch = 4;  // lines in flight per thread when a thread owns several

struct McArgs {
  // What the portable kernels' helpers need (workspaces, Control, epochs,
  // stats, error record, the payload); `slots` stays unused.
  cuda::KernelArgs k;
  char* uc;  // this rank's share, unicast mapping (its own stores)
  char* mc;  // the multicast mapping on this device (ld_reduce)
  MulticastLayout ml;
};

// Kernel template arguments: the floating-point element types (elem_type.h),
// as ints.  (The switch sums in fp32; no integer reduction here.)
constexpr int kF32 = static_cast<int>(Elem::kF32);
constexpr int kBf16 = static_cast<int>(Elem::kBf16);
constexpr int kF16 = static_cast<int>(Elem::kF16);

// The C++ type of an element type.
template <int E>
struct ElemOf;
template <>
struct ElemOf<kF32> {
  using type = float;
};
template <>
struct ElemOf<kBf16> {
  using type = __nv_bfloat16;
};
template <>
struct ElemOf<kF16> {
  using type = __half;
};

// The same bytes are reached through two virtual aliases (unicast and
// multicast): order this thread's accesses across them.
__device__ __forceinline__ void FenceProxyAlias() { asm volatile("fence.proxy.alias;" ::: "memory"); }
// Release: the block's payload stores (before a bar.sync) precede the flag.
__device__ __forceinline__ void PublishFlag(MulticastFlag* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// The sum of every rank's flag word, through the multicast address.
__device__ __forceinline__ uint64_t ReduceFlagRelaxed(const MulticastFlag* mc) {
  uint64_t v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.u64 %0, [%1];" : "=l"(v) : "l"(mc) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ReduceFlagAcquire(const MulticastFlag* mc) {
  uint64_t v;
  asm volatile("multimem.ld_reduce.acquire.sys.global.add.u64 %0, [%1];" : "=l"(v) : "l"(mc) : "memory");
  return v;
}

// One 16-byte line, summed over every rank by the switch with fp32
// accumulation and rounded once to the element type.
template <int E>
__device__ __forceinline__ uint4 ReduceLine(const uint4* mc);
template <>
__device__ __forceinline__ uint4 ReduceLine<kF32>(const uint4* mc) {
  uint4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc)
               : "memory");
  return v;
}
template <>
__device__ __forceinline__ uint4 ReduceLine<kBf16>(const uint4* mc) {
  uint4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc)
               : "memory");
  return v;
}
template <>
__device__ __forceinline__ uint4 ReduceLine<kF16>(const uint4* mc) {
  uint4 v;
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(mc)
               : "memory");
  return v;
}

// This thread's lines: first, first + stride, ... (the same ownership as
// BlockOfLine with kMulticastLinesPerBlock lines per block; replayed on the
// host by the tests through MulticastFirstLine / MulticastLineStride).
#define SIFAR_MC_FOR_EACH_LINE(line, lines)                                                    \
  for (size_t line = MulticastFirstLine(blockIdx.x, threadIdx.x); line < (lines);              \
       line += MulticastLineStride())

// Pulls this thread's lines, kBatch reductions in flight before the stores.
template <int E>
__device__ __forceinline__ void PullLines(const McArgs& a, const uint4* all) {
  const size_t stride = MulticastLineStride();
  const size_t lines = a.k.nbytes / 16;
  uint4* out = static_cast<uint4*>(a.k.out);
  for (size_t base = MulticastFirstLine(blockIdx.x, threadIdx.x); base < lines;
       base += kBatch * stride) {
    uint4 v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (base + j * stride < lines) v[j] = ReduceLine<E>(all + base + j * stride);
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (base + j * stride < lines) out[base + j * stride] = v[j];
  }
}

// One all-reduce of this block at epoch s.epoch.  False when it gave up
// (this rank timed out, or another rank failed the communicator).
template <int E>
__device__ bool Step(const McArgs& a, const cuda::Ws& w, cuda::CallState& s) {
  const uint32_t e = s.epoch;
  const size_t slot = MulticastSlotOffset(a.ml, e);
  uint4* mine = reinterpret_cast<uint4*>(a.uc + slot + a.ml.payload);
  const uint4* all = reinterpret_cast<const uint4*>(a.mc + slot + a.ml.payload);
  const size_t flag = MulticastFlagOffset(a.ml, e, blockIdx.x);
  MulticastFlag* my_flag = reinterpret_cast<MulticastFlag*>(a.uc + flag);
  const MulticastFlag* all_flags = reinterpret_cast<const MulticastFlag*>(a.mc + flag);

  // 1. Publish the partial, then the flag.  (Our multicast reads of this slot
  // at e-2 returned their values before step e-1, so they cannot see these
  // writes.)  The proxy fence orders the unicast writes before any multicast
  // access to the same bytes; the release after the barrier publishes them.
  const uint4* in = static_cast<const uint4*>(a.k.in);
  SIFAR_MC_FOR_EACH_LINE(line, a.k.nbytes / 16) { mine[line] = in[line]; }
  FenceProxyAlias();
  __syncthreads();
  if (threadIdx.x == 0) {
    PublishFlag(my_flag, e);
    FenceProxyAlias();  // our own flag, read back below through the multicast alias
  }

  // 2. Speculative pull: the flag sum and the payload issued together.
  const int n = a.k.nranks;
  uint64_t flag_sum = 0;
  if (threadIdx.x == 0) flag_sum = ReduceFlagRelaxed(all_flags);
  PullLines<E>(a, all);
  if (__syncthreads_or(threadIdx.x == 0 && MulticastFlagsValid(flag_sum, n, e))) return true;

  // 3. Mis-speculation: wait (acquire) until every rank's flag is e, then
  // pull again; the barrier orders the other threads' loads after it.  The
  // bound and the failure record are the portable kernels'.
  bool valid = false;
  if (threadIdx.x == 0) {
    s.retried = true;  // counted by EndCall
    for (uint32_t spins = 0;; ++spins) {
      if (MulticastFlagsValid(ReduceFlagAcquire(all_flags), n, e)) {
        valid = true;
        break;
      }
      if (cuda::Expired(w, s, 0, spins)) {
        if (s.failed_peer != -2) {  // our own deadline passed (-2: another rank failed)
          s.failed_peer = -1;       // the flag sum does not say which peer is late
          cuda::RecordFailure(w, kMulticast, s);
          atomicAdd(w.stat(kMulticast, kTimeouts), 1ull);
        }
        break;
      }
    }
  }
  if (!__syncthreads_or(valid)) return false;
  PullLines<E>(a, all);
  return true;
}

// The portable kernels' call framing (core/device.cuh): the control words
// read once per block, epochs, skew, counters, the call count and trace.
template <int E>
__global__ void __launch_bounds__(kThreads) MulticastAllReduceKernel(McArgs a) {
  using T = typename ElemOf<E>::type;
  const cuda::Ws w{a.k};
  __shared__ cuda::BlockStart b0;
  if (threadIdx.x == 0) cuda::ReadBlockStart(w, kMulticast, b0);
  __syncthreads();
  const cuda::BlockStart st = b0;
  if (st.dropped()) {  // testing.drop_rank: this block never arrives
    SIFAR_MC_FOR_EACH_LINE(line, a.k.nbytes / 16) {
      static_cast<uint4*>(a.k.out)[line] = static_cast<const uint4*>(a.k.in)[line];
    }
    return;
  }
  if (st.failed()) {  // a failed communicator never returns a plausible result
    cuda::FillNaN<T>(a.k.out, a.k.nbytes);
    return;
  }
  uint32_t epoch = st.epoch;
  cuda::CallState s{};
  s.timeout_ns = st.timeout_ns;
  bool ok = true, warp0_retried = false;
  for (int i = 0; i < a.k.repeat && ok; ++i) {
    // Multicast flags hold whole epochs, not tags: when the tag bits wrap
    // there is nothing to clear (NextEpoch keeps the parity alternating).
    cuda::NextCall(w, st, epoch, s);
    cuda::InjectSkew(w, st, epoch);
    ok = Step<E>(a, w, s);  // the same outcome in every thread of the block
    warp0_retried |= cuda::EndCall(w, kMulticast, s);
  }
  if (!ok) {
    cuda::FillNaN<T>(a.k.out, a.k.nbytes);
    return;
  }
  cuda::CommitBlock(w, kMulticast, st, epoch, warp0_retried);
}

}  // namespace

// ============================================================ host code ==
namespace {

[[noreturn]] void ThrowCuda(const std::string& what, const std::string& detail) {
  throw std::runtime_error("sifar_jax multicast: " + what + " failed: " + detail);
}

// Runtime calls: counted, then checked like every other CUDA call.
#define SIFAR_MC_CUDART(expr)  \
  do {                         \
    CountMulticastCudaCall();  \
    SIFAR_CUDA_CHECK(expr);    \
  } while (0)

// The driver entry points the multicast code uses (CUDA >= 12.1 ABI).
struct Driver {
  PFN_cuInit_v2000 Init;
  PFN_cuGetErrorName_v6000 GetErrorName;
  PFN_cuDeviceGet_v2000 DeviceGet;
  PFN_cuDeviceGetAttribute_v2000 DeviceGetAttribute;
  PFN_cuMemGetAllocationGranularity_v10020 MemGetAllocationGranularity;
  PFN_cuMulticastGetGranularity_v12010 MulticastGetGranularity;
  PFN_cuMulticastCreate_v12010 MulticastCreate;
  PFN_cuMulticastAddDevice_v12010 MulticastAddDevice;
  PFN_cuMulticastBindMem_v12010 MulticastBindMem;
  PFN_cuMulticastUnbind_v12010 MulticastUnbind;
  PFN_cuMemCreate_v10020 MemCreate;
  PFN_cuMemRelease_v10020 MemRelease;
  PFN_cuMemAddressReserve_v10020 MemAddressReserve;
  PFN_cuMemAddressFree_v10020 MemAddressFree;
  PFN_cuMemMap_v10020 MemMap;
  PFN_cuMemUnmap_v10020 MemUnmap;
  PFN_cuMemSetAccess_v10020 MemSetAccess;
};

constexpr unsigned int kDriverAbi = 12010;  // multicast appeared in CUDA 12.1

template <typename F>
void Resolve(F* fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  CountMulticastCudaCall();
  cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, kDriverAbi, cudaEnableDefault, &q);
  if (e != cudaSuccess) {
    cudaGetLastError();
    ThrowCuda(std::string("cudaGetDriverEntryPointByVersion(") + symbol + ")",
              cudaGetErrorName(e));
  }
  if (q != cudaDriverEntryPointSuccess || p == nullptr)
    ThrowCuda(std::string("cudaGetDriverEntryPointByVersion(") + symbol + ")",
              q == cudaDriverEntryPointVersionNotSufficent
                  ? "the driver is older than CUDA 12.1 (no multicast)"
                  : "symbol not found in the driver");
  *fn = reinterpret_cast<F>(p);
}

const Driver& LoadDriver() {
  static std::mutex mu;
  static Driver d{};
  static bool loaded = false;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded) return d;
  Driver t{};
  Resolve(&t.Init, "cuInit");
  Resolve(&t.GetErrorName, "cuGetErrorName");
  Resolve(&t.DeviceGet, "cuDeviceGet");
  Resolve(&t.DeviceGetAttribute, "cuDeviceGetAttribute");
  Resolve(&t.MemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  Resolve(&t.MulticastGetGranularity, "cuMulticastGetGranularity");
  Resolve(&t.MulticastCreate, "cuMulticastCreate");
  Resolve(&t.MulticastAddDevice, "cuMulticastAddDevice");
  Resolve(&t.MulticastBindMem, "cuMulticastBindMem");
  Resolve(&t.MulticastUnbind, "cuMulticastUnbind");
  Resolve(&t.MemCreate, "cuMemCreate");
  Resolve(&t.MemRelease, "cuMemRelease");
  Resolve(&t.MemAddressReserve, "cuMemAddressReserve");
  Resolve(&t.MemAddressFree, "cuMemAddressFree");
  Resolve(&t.MemMap, "cuMemMap");
  Resolve(&t.MemUnmap, "cuMemUnmap");
  Resolve(&t.MemSetAccess, "cuMemSetAccess");
  CountMulticastCudaCall();
  CUresult r = t.Init(0);
  if (r != CUDA_SUCCESS) ThrowCuda("cuInit(0)", "CUresult " + std::to_string(static_cast<int>(r)));
  d = t;
  loaded = true;
  return d;
}

// Driver calls: counted and checked; the error named by the driver.
void CheckCu(CUresult r, const char* expr) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  CountMulticastCudaCall();
  if (LoadDriver().GetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown";
  ThrowCuda(expr, std::string(name) + " (" + std::to_string(static_cast<int>(r)) + ")");
}
#define SIFAR_MC_CU(expr)         \
  do {                            \
    CountMulticastCudaCall();     \
    CheckCu((expr), #expr);       \
  } while (0)

// The shared device switch, its CUDA calls counted.
class McOnDevice : public OnDevice {
 public:
  explicit McOnDevice(int ordinal) : OnDevice(ordinal, CountMulticastCudaCall) {}
};

struct RankResources {
  int ordinal = -1;
  CUdevice dev = 0;
  CUmemGenericAllocationHandle phys = 0;
  bool phys_created = false, bound = false;
  CUdeviceptr uc = 0, mc = 0;
  bool uc_reserved = false, uc_mapped = false, mc_reserved = false, mc_mapped = false;
};

class DriverMulticastGroup : public MulticastGroup {
 public:
  CUmemGenericAllocationHandle handle = 0;
  bool created = false;
  std::vector<RankResources> ranks;

  ~DriverMulticastGroup() override { Teardown(); }

  // Best effort, never throws: unmap and free the VA ranges, unbind, release.
  void Teardown() noexcept {
    try {
      const Driver& d = LoadDriver();
      const size_t size = layout.alloc_bytes;
      for (RankResources& r : ranks) {
        if (!(r.uc_mapped || r.mc_mapped)) continue;
        McOnDevice on(r.ordinal);
        CountMulticastCudaCall();
        cudaDeviceSynchronize();  // a kernel may still use the mappings
        cudaGetLastError();
      }
      for (RankResources& r : ranks) {
        if (r.mc_mapped) CountMulticastCudaCall(), d.MemUnmap(r.mc, size);
        if (r.mc_reserved) CountMulticastCudaCall(), d.MemAddressFree(r.mc, size);
        if (r.uc_mapped) CountMulticastCudaCall(), d.MemUnmap(r.uc, size);
        if (r.uc_reserved) CountMulticastCudaCall(), d.MemAddressFree(r.uc, size);
        if (r.bound) CountMulticastCudaCall(), d.MulticastUnbind(handle, r.dev, 0, size);
        if (r.phys_created) CountMulticastCudaCall(), d.MemRelease(r.phys);
        r = RankResources{r.ordinal, r.dev};
      }
      if (created) CountMulticastCudaCall(), d.MemRelease(handle);
      created = false;
    } catch (...) {
    }
  }
};

void ValidateOrdinals(const std::vector<int>& ordinals) {
  if (ordinals.empty() || static_cast<int>(ordinals.size()) > kMaxRanks)
    throw std::invalid_argument("sifar_jax multicast: a group needs 1.." + std::to_string(kMaxRanks) +
                                " devices");
  for (size_t i = 0; i < ordinals.size(); ++i) {
    if (ordinals[i] < 0) throw std::invalid_argument("sifar_jax multicast: negative device ordinal");
    for (size_t j = 0; j < i; ++j)
      if (ordinals[i] == ordinals[j])
        throw std::invalid_argument("sifar_jax multicast: device " + std::to_string(ordinals[i]) +
                                    " appears twice in the group");
  }
}

CUmemAllocationProp PhysicalProp(CUdevice dev) {
  CUmemAllocationProp p;
  std::memset(&p, 0, sizeof(p));
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = static_cast<int>(dev);
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;  // one process: nothing to export
  return p;
}

void MapOnDevice(const Driver& d, CUdeviceptr* va, bool* reserved, bool* mapped, size_t size,
                 size_t align, CUmemGenericAllocationHandle h, CUdevice dev) {
  SIFAR_MC_CU(d.MemAddressReserve(va, size, align, 0, 0));
  *reserved = true;
  SIFAR_MC_CU(d.MemMap(*va, size, 0, h, 0));
  *mapped = true;
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = static_cast<int>(dev);
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  SIFAR_MC_CU(d.MemSetAccess(*va, size, &access, 1));
}

}  // namespace

int FirstDeviceWithoutMulticast(const std::vector<int>& ordinals) {
  ValidateOrdinals(ordinals);
  const Driver& d = LoadDriver();
  for (int ord : ordinals) {
    CUdevice dev = 0;
    int supported = 0;
    SIFAR_MC_CU(d.DeviceGet(&dev, ord));
    SIFAR_MC_CU(d.DeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev));
    if (!supported) return ord;
  }
  return -1;
}

std::unique_ptr<MulticastGroup> CreateMulticastGroup(const std::vector<int>& ordinals,
                                                     size_t slot_bytes) {
  // The guard, first: the environment (no CUDA call when it refuses), then
  // the arguments, then the devices' multicast support (read-only queries).
  if (std::optional<std::string> r = MulticastRefusal(ProcessEnv(), DeviceSupport::kUnknown)) {
    CountMulticastRefusal();
    throw MulticastRefused(*r);
  }
  ValidateOrdinals(ordinals);
  if (slot_bytes == 0 || slot_bytes % 16 != 0)
    throw std::invalid_argument("sifar_jax multicast: slot_bytes must be a positive multiple of 16");
  if (std::optional<std::string> r = MulticastRefusalHere(ordinals)) throw MulticastRefused(*r);
  CountMulticastSetup();

  const Driver& d = LoadDriver();
  const int n = static_cast<int>(ordinals.size());
  auto g = std::make_unique<DriverMulticastGroup>();
  g->ordinals = ordinals;
  g->ranks.resize(n);
  for (int r = 0; r < n; ++r) {
    g->ranks[r].ordinal = ordinals[r];
    SIFAR_MC_CU(d.DeviceGet(&g->ranks[r].dev, ordinals[r]));
  }

  // Granularities: the physical allocations' (every device) and the
  // multicast object's, minimum and recommended.
  size_t mem_gran = 1;
  for (const RankResources& r : g->ranks) {
    CUmemAllocationProp p = PhysicalProp(r.dev);
    size_t gran = 0;
    SIFAR_MC_CU(d.MemGetAllocationGranularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    mem_gran = Lcm(mem_gran, gran);
  }
  CUmulticastObjectProp mp;
  std::memset(&mp, 0, sizeof(mp));
  mp.numDevices = static_cast<unsigned int>(n);
  mp.size = MulticastNeedBytes(slot_bytes);
  mp.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
  mp.flags = 0;
  size_t mc_min = 0, mc_rec = 0;
  SIFAR_MC_CU(d.MulticastGetGranularity(&mc_min, &mp, CU_MULTICAST_GRANULARITY_MINIMUM));
  SIFAR_MC_CU(d.MulticastGetGranularity(&mc_rec, &mp, CU_MULTICAST_GRANULARITY_RECOMMENDED));
  g->layout = MakeMulticastLayout(slot_bytes, mc_min, mc_rec, mem_gran);
  const size_t size = g->layout.alloc_bytes;
  if (size % mc_min != 0 || size % mem_gran != 0 || size < g->layout.need)
    throw std::logic_error("sifar_jax multicast: layout size " + std::to_string(size) +
                           " violates the granularity");
  const size_t gran = g->layout.granularity;
  const size_t align = (gran & (gran - 1)) == 0 ? gran : 0;  // VA alignment: a power of two

  // The multicast object; every device joins before any memory is bound.
  mp.size = size;
  SIFAR_MC_CU(d.MulticastCreate(&g->handle, &mp));
  g->created = true;
  for (const RankResources& r : g->ranks) SIFAR_MC_CU(d.MulticastAddDevice(g->handle, r.dev));

  // Each device's physical share, bound at offset 0 of the object.
  for (RankResources& r : g->ranks) {
    McOnDevice on(r.ordinal);
    CUmemAllocationProp p = PhysicalProp(r.dev);
    SIFAR_MC_CU(d.MemCreate(&r.phys, size, &p, 0));
    r.phys_created = true;
    SIFAR_MC_CU(d.MulticastBindMem(g->handle, 0, r.phys, 0, size, 0));
    r.bound = true;
  }

  // Each device maps its own share (unicast) and the object (multicast), and
  // zeroes its share (flags start at epoch 0, which no all-reduce uses).
  g->unicast.assign(n, nullptr);
  g->multicast.assign(n, nullptr);
  for (int i = 0; i < n; ++i) {
    RankResources& r = g->ranks[i];
    McOnDevice on(r.ordinal);
    MapOnDevice(d, &r.uc, &r.uc_reserved, &r.uc_mapped, size, align, r.phys, r.dev);
    MapOnDevice(d, &r.mc, &r.mc_reserved, &r.mc_mapped, size, align, g->handle, r.dev);
    SIFAR_MC_CUDART(cudaMemset(reinterpret_cast<void*>(r.uc), 0, size));
    SIFAR_MC_CUDART(cudaDeviceSynchronize());
    g->unicast[i] = reinterpret_cast<char*>(r.uc);
    g->multicast[i] = reinterpret_cast<char*>(r.mc);
  }
  return g;
}

cudaError_t LaunchMulticastAllReduce(const MulticastGroup& group, const MulticastCall& call,
                                     cudaStream_t stream) {
  const int n = group.nranks();
  if (call.rank < 0 || call.rank >= n || static_cast<int>(group.unicast.size()) != n ||
      static_cast<int>(group.multicast.size()) != n || call.bytes % 16 != 0 ||
      call.bytes > group.layout.slot_bytes || call.repeat < 1 || call.err == nullptr ||
      call.elem_type < kF32 || call.elem_type > kF16)
    return cudaErrorInvalidValue;
  for (int r = 0; r < n; ++r)
    if (call.workspaces[r] == nullptr) return cudaErrorInvalidValue;
  if (call.bytes == 0) return cudaSuccess;

  McArgs a;
  std::memset(&a, 0, sizeof(a));
  a.k.in = call.in;
  a.k.out = call.out;
  a.k.nbytes = call.bytes;
  a.k.rank = call.rank;
  a.k.nranks = n;
  a.k.repeat = call.repeat;
  for (int r = 0; r < n; ++r) a.k.ws[r] = call.workspaces[r];
  a.k.err = call.err;
  a.k.lay = call.layout;
  a.k.chain = 0;
  a.k.lane_at = call.layout.LaneAt(0);  // multicast keeps its epochs in lane 0
  a.uc = group.unicast[call.rank];
  a.mc = group.multicast[call.rank];
  a.ml = group.layout;
  const int grid = MulticastBlocks(call.bytes / 16);
  CountMulticastCudaCall();
  switch (call.elem_type) {
    case kF32: MulticastAllReduceKernel<kF32><<<grid, kThreads, 0, stream>>>(a); break;
    case kBf16: MulticastAllReduceKernel<kBf16><<<grid, kThreads, 0, stream>>>(a); break;
    default: MulticastAllReduceKernel<kF16><<<grid, kThreads, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

cudaError_t PreloadMulticastKernels() {
  cudaFuncAttributes attr;
  const void* kernels[] = {reinterpret_cast<const void*>(MulticastAllReduceKernel<kF32>),
                           reinterpret_cast<const void*>(MulticastAllReduceKernel<kBf16>),
                           reinterpret_cast<const void*>(MulticastAllReduceKernel<kF16>)};
  for (const void* k : kernels) {  // not counted: loading code is no multicast call
    cudaError_t e = cudaFuncGetAttributes(&attr, k);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace sifar
