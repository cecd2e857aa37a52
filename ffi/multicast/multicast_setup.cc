// Multicast: the guard, the call counters and the set-up arithmetic.  Pure
// host code (no CUDA call anywhere in this file); the driver work lives in
// cuda_multicast.cu and runs only after MulticastRefusalHere has passed.
#include <atomic>
#include <cstdlib>
#include <limits>

#include "multicast/multicast.h"

namespace sifar {

namespace {
std::atomic<uint64_t> g_cuda_calls{0};
std::atomic<uint64_t> g_refusals{0};
std::atomic<uint64_t> g_setups{0};

constexpr const char* kNoDeviceSupport =
    "the GPUs do not report multicast support (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)";

// Python's str.strip() on ASCII: the characters str.isspace() accepts.
bool IsPySpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' ||
         (c >= '\x1c' && c <= '\x1f');
}
std::string Strip(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && IsPySpace(s[b])) ++b;
  while (e > b && IsPySpace(s[e - 1])) --e;
  return s.substr(b, e - b);
}
}  // namespace

void CountMulticastCudaCall() { g_cuda_calls.fetch_add(1, std::memory_order_relaxed); }
void CountMulticastRefusal() { g_refusals.fetch_add(1, std::memory_order_relaxed); }
void CountMulticastSetup() { g_setups.fetch_add(1, std::memory_order_relaxed); }
MulticastCounters GetMulticastCounters() {
  return {g_cuda_calls.load(), g_refusals.load(), g_setups.load()};
}

EnvLookup ProcessEnv() {
  return [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

std::optional<std::string> MulticastRefusal(const EnvLookup& env, DeviceSupport devices) {
  // Opt-in: exactly "1" (as the Python guard: no stripping here).
  std::optional<std::string> enable = env(kMulticastEnableVar);
  if (!enable || *enable != "1")
    return std::string("NVLink multicast is opt-in: set ") + kMulticastEnableVar +
           "=1 on a host where it is safe";
  for (const DisablingVar& d : kMulticastDisabling) {
    std::optional<std::string> v = env(d.name);
    if (v && Strip(*v) == d.off)
      return std::string(d.name) + "=" + d.off +
             " is set: this host has NVLink multicast turned off";
  }
  if (devices == DeviceSupport::kNo) return std::string(kNoDeviceSupport);
  return std::nullopt;
}

#ifdef SIFAR_WITH_CUDA
// cuda_multicast.cu: the first device (by rank) without
// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, or -1.  Read-only queries.
int FirstDeviceWithoutMulticast(const std::vector<int>& ordinals);
#endif

std::optional<std::string> MulticastRefusalHere(const std::vector<int>& ordinals) {
  // The environment first: when it refuses, no CUDA call at all.
  std::optional<std::string> r = MulticastRefusal(ProcessEnv(), DeviceSupport::kUnknown);
  if (!r) {
#ifdef SIFAR_WITH_CUDA
    // Support that cannot be confirmed is no support.
    try {
      int bad = FirstDeviceWithoutMulticast(ordinals);
      if (bad >= 0)
        r = std::string(kNoDeviceSupport) + " (device ordinal " + std::to_string(bad) + ")";
    } catch (const std::exception& e) {
      r = std::string("could not confirm the GPUs' multicast support: ") + e.what();
    }
#else
    (void)ordinals;
    r = std::string("sifar_jax was built without its CUDA backend");
#endif
  }
  if (r) CountMulticastRefusal();
  return r;
}

#ifndef SIFAR_WITH_CUDA
std::unique_ptr<MulticastGroup> CreateMulticastGroup(const std::vector<int>& ordinals,
                                                     size_t slot_bytes) {
  (void)slot_bytes;
  // Always refuses here (no CUDA backend), but through the same guard.
  std::optional<std::string> r = MulticastRefusalHere(ordinals);
  throw MulticastRefused(r ? *r : std::string("sifar_jax was built without its CUDA backend"));
}
#endif

// ------------------------------------------------------------- arithmetic --
size_t RoundUpTo(size_t x, size_t a) {
  if (a == 0) throw std::invalid_argument("sifar_jax multicast: granularity must be positive");
  size_t r = x % a;
  if (r == 0) return x;
  if (x > std::numeric_limits<size_t>::max() - (a - r))
    throw std::overflow_error("sifar_jax multicast: size overflows when rounded up");
  return x + (a - r);
}

size_t Lcm(size_t a, size_t b) {
  if (a == 0 || b == 0) throw std::invalid_argument("sifar_jax multicast: granularity must be positive");
  size_t x = a, y = b;
  while (y != 0) {
    size_t t = x % y;
    x = y;
    y = t;
  }
  size_t q = a / x;
  if (q > std::numeric_limits<size_t>::max() / b)
    throw std::overflow_error("sifar_jax multicast: granularities have no representable lcm");
  return q * b;
}

size_t MulticastNeedBytes(size_t slot_bytes) {
  size_t payload = AlignUp(slot_bytes, kAlign);
  size_t flags = AlignUp(kMaxBlocks * sizeof(MulticastFlag), kAlign);
  return 2 * (payload + flags);
}

MulticastLayout MakeMulticastLayout(size_t slot_bytes, size_t mc_min, size_t mc_rec,
                                    size_t mem_gran) {
  if (slot_bytes == 0 || slot_bytes % 16 != 0)
    throw std::invalid_argument("sifar_jax multicast: slot_bytes must be a positive multiple of 16");
  if (slot_bytes > (size_t{1} << 40))
    throw std::invalid_argument("sifar_jax multicast: slot_bytes is implausibly large");
  if (mc_min == 0 || mc_rec == 0 || mem_gran == 0)
    throw std::invalid_argument("sifar_jax multicast: the driver reported a zero granularity");
  MulticastLayout m{};
  m.slot_bytes = slot_bytes;
  m.slot0 = 0;
  m.payload = 0;
  m.flags = AlignUp(slot_bytes, kAlign);
  m.slot_stride = m.flags + AlignUp(kMaxBlocks * sizeof(MulticastFlag), kAlign);
  m.need = m.slot0 + 2 * m.slot_stride;
  // Legal sizes/offsets: multiples of the minimum multicast granularity and of
  // the allocation granularity.  The recommended one is a multiple of the
  // minimum in practice; the lcm keeps it legal if not.
  const size_t legal = Lcm(mc_min, mem_gran);
  const size_t best = Lcm(legal, mc_rec);
  const size_t with_legal = RoundUpTo(m.need, legal);
  const size_t with_best = RoundUpTo(m.need, best);
  m.recommended = with_best <= 2 * with_legal;
  m.granularity = m.recommended ? best : legal;
  m.alloc_bytes = m.recommended ? with_best : with_legal;
  return m;
}

}  // namespace sifar
