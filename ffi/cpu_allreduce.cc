// CPU reference backend: every algorithm of the SiFAR protocol on XLA:CPU,
// where each host device is a rank running on its own thread and workspaces
// are shared host memory.  The slot, epoch, barrier, validation and retry
// rules are those of protocol.h, exactly as the CUDA kernels use them; a
// CPU rank behaves like a single thread block.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm.h"
#include "handlers.h"
#include "protocol.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace {

// ----------------------------------------------------------------- numbers --
float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t F32ToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float F16ToF32(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
uint16_t F32ToF16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

enum class Elem { kF32, kBf16, kF16 };

// Adds the elements held in `words` to acc (acc = first ? x : acc + x), in fp32.
void Accumulate(Elem t, const uint32_t* words, size_t nwords, float* acc, bool first) {
  if (t == Elem::kF32) {
    for (size_t i = 0; i < nwords; ++i) {
      float v;
      std::memcpy(&v, &words[i], 4);
      acc[i] = first ? v : acc[i] + v;
    }
    return;
  }
  for (size_t i = 0; i < nwords; ++i) {
    uint16_t lo = static_cast<uint16_t>(words[i]), hi = static_cast<uint16_t>(words[i] >> 16);
    float a = t == Elem::kBf16 ? Bf16ToF32(lo) : F16ToF32(lo);
    float b = t == Elem::kBf16 ? Bf16ToF32(hi) : F16ToF32(hi);
    acc[2 * i] = first ? a : acc[2 * i] + a;
    acc[2 * i + 1] = first ? b : acc[2 * i + 1] + b;
  }
}

// Rounds once to the payload type.
void Store(Elem t, const float* acc, size_t nwords, uint32_t* out) {
  if (t == Elem::kF32) {
    std::memcpy(out, acc, nwords * 4);
    return;
  }
  for (size_t i = 0; i < nwords; ++i) {
    uint16_t a = t == Elem::kBf16 ? F32ToBf16(acc[2 * i]) : F32ToF16(acc[2 * i]);
    uint16_t b = t == Elem::kBf16 ? F32ToBf16(acc[2 * i + 1]) : F32ToF16(acc[2 * i + 1]);
    out[i] = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
  }
}

// ------------------------------------------------------ shared-memory access --
// Every word a peer may touch concurrently is accessed atomically (relaxed);
// ordering comes from the barrier flags (release/acquire) or from the epoch
// carried inside the same 8-byte word.
template <typename T>
T LoadRelaxed(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
template <typename T>
void StoreRelaxed(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

void CopyOut(uint32_t* dst, const uint32_t* src, size_t nwords) {  // src may be shared
  for (size_t i = 0; i < nwords; ++i) dst[i] = LoadRelaxed(&src[i]);
}
void CopyIn(uint32_t* dst, const uint32_t* src, size_t nwords) {  // dst is shared
  for (size_t i = 0; i < nwords; ++i) StoreRelaxed(&dst[i], src[i]);
}

struct Timeout {
  int peer;
};

// One rank's view of one all-reduce call.
class RankCall {
 public:
  RankCall(Comm& comm, int group, int rank, int algorithm, Elem elem, const uint32_t* in,
           uint32_t* out, size_t nwords, char* const* slots)
      : comm_(comm),
        lay_(comm.layout()),
        grp_(comm.group(group)),
        rank_(rank),
        n_(comm.nranks()),
        algorithm_(algorithm),
        elem_(elem),
        in_(in),
        out_(out),
        nwords_(nwords),
        slots_(slots),
        acc_(elem == Elem::kF32 ? nwords : 2 * nwords) {}

  char* ws(int r) const { return grp_.workspaces[r]; }
  Control* ctl(int r) const { return reinterpret_cast<Control*>(ws(r) + lay_.control); }
  uint32_t* epochs() const { return reinterpret_cast<uint32_t*>(ws(rank_) + lay_.epochs); }
  uint32_t* barrier(int r) const { return reinterpret_cast<uint32_t*>(ws(r) + lay_.barrier); }
  unsigned long long* stats() const {
    return reinterpret_cast<unsigned long long*>(ws(rank_) + lay_.stats);
  }
  // The internal slot of this epoch's parity, or the user's buffer.
  char* slot(int r) const {
    return slots_ ? slots_[r] : ws(r) + lay_.slots + SlotParity(epoch_) * lay_.slot.total;
  }
  uint32_t* plain(int r) const { return reinterpret_cast<uint32_t*>(slot(r) + lay_.slot.plain); }
  uint32_t* tmp(int r) const { return reinterpret_cast<uint32_t*>(slot(r) + lay_.slot.tmp); }
  // Epoch-tagged words from rank `src`, in rank `owner`'s slot.
  uint64_t* ll(int owner, int src) const {
    return reinterpret_cast<uint64_t*>(slot(owner) + lay_.slot.ll +
                                       src * LLRegionBytes(lay_.slot.slot_bytes));
  }
  uint32_t* flag(int r) const { return reinterpret_cast<uint32_t*>(slot(r) + lay_.slot.flags); }

  void Count(int field) { __atomic_fetch_add(&stats()[algorithm_ * kNumStats + field], 1ull, __ATOMIC_RELAXED); }

  // Waits until pred() holds; false once the deadline passes or another rank
  // has declared the communicator failed.  Yields: 8 ranks share 2 cores.
  template <typename Pred>
  bool SpinUntil(Pred pred) {
    for (uint64_t i = 0;; ++i) {
      if (pred()) return true;
      if ((i & 15) == 0) {
        if (LoadRelaxed(&ctl(rank_)->failed)) return false;
        if (std::chrono::steady_clock::now() > deadline_) return false;
      }
      if (i < 256) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  void Barrier(uint32_t phase) {
    const uint32_t v = BarrierValue(epoch_, phase);
    for (int p = 0; p < n_; ++p)
      if (p != rank_) __atomic_store_n(&barrier(p)[rank_], v, __ATOMIC_RELEASE);
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      const uint32_t* f = &barrier(rank_)[p];
      if (!SpinUntil([&] { return Reached(__atomic_load_n(f, __ATOMIC_ACQUIRE), v); }))
        throw Timeout{p};
    }
  }

  // acc <- sum over ranks 0..N-1 of words[r][begin:end), own rank from `in_`.
  void ReduceFrom(const std::vector<const uint32_t*>& words, size_t begin, size_t end) {
    const size_t k = end - begin;
    std::vector<uint32_t> w(k);
    for (int r = 0; r < n_; ++r) {
      if (r == rank_) std::memcpy(w.data(), in_ + begin, k * 4);
      else CopyOut(w.data(), words[r] + begin, k);
      Accumulate(elem_, w.data(), k, acc_.data() + (elem_ == Elem::kF32 ? begin : 2 * begin),
                 r == 0);
    }
    Store(elem_, acc_.data() + (elem_ == Elem::kF32 ? begin : 2 * begin), k, out_ + begin);
  }

  std::vector<const uint32_t*> Peers(uint32_t* (RankCall::*region)(int) const) const {
    std::vector<const uint32_t*> v(n_);
    for (int r = 0; r < n_; ++r) v[r] = (this->*region)(r);
    return v;
  }

  void Oneshot(bool bottom_barrier) {
    CopyIn(plain(rank_), in_, nwords_);
    Barrier(kTop);
    ReduceFrom(Peers(&RankCall::plain), 0, nwords_);
    if (bottom_barrier) Barrier(kBottom);
  }

  void Twoshot() {
    CopyIn(plain(rank_), in_, nwords_);
    Barrier(kTop);
    const size_t lines = nwords_ / 4;  // 16-byte lines, as on the GPU
    Piece mine = PieceOf(0, lines, rank_, n_);
    ReduceFrom(Peers(&RankCall::plain), mine.begin * 4, mine.end * 4);
    CopyIn(tmp(rank_) + mine.begin * 4, out_ + mine.begin * 4, (mine.end - mine.begin) * 4);
    Barrier(kMid);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      Piece p = PieceOf(0, lines, q, n_);
      CopyOut(out_ + p.begin * 4, tmp(q) + p.begin * 4, (p.end - p.begin) * 4);
    }
    Barrier(kBottom);
  }

  // The paper's validation: reduce a per-rank flag alongside the payload and
  // accept iff the flags sum to N * epoch; otherwise pull everything again.
  // (Here the flag is loaded first with acquire, which the host memory model
  // needs; the GPU kernel issues both loads together as the paper does.)
  void SifarFlag() {
    CopyIn(plain(rank_), in_, nwords_);
    __atomic_store_n(flag(rank_), epoch_, __ATOMIC_RELEASE);
    bool retried = false;
    for (;;) {
      uint64_t sum = 0;
      int stale = -1;
      for (int p = 0; p < n_; ++p) {
        uint32_t f = __atomic_load_n(flag(p), __ATOMIC_ACQUIRE);
        sum += f;
        if (f != epoch_) stale = p;
      }
      ReduceFrom(Peers(&RankCall::plain), 0, nwords_);
      if (sum == static_cast<uint64_t>(n_) * epoch_) break;
      if (!retried) Count(kRetries), retried = true;
      // Mis-speculation: wait for the late flag, then re-pull the whole payload.
      const uint32_t* f = flag(stale);
      if (!SpinUntil([&] { return __atomic_load_n(f, __ATOMIC_ACQUIRE) == epoch_; }))
        throw Timeout{stale};
    }
  }

  // SiFAR: publish epoch-tagged words, pull every peer's words at once,
  // re-read only the words whose tag is stale.  No flag, no barrier.  With
  // `push` the words go into every peer's slot and each rank reads its own.
  void Sifar(bool push) {
    for (int p = 0; p < n_; ++p) {  // publish into our slot (pull) or every peer's (push)
      if (push ? p == rank_ : p != rank_) continue;
      uint64_t* dst = ll(p, rank_);
      for (size_t i = 0; i < nwords_; ++i) StoreRelaxed(&dst[i], PackLL(in_[i], epoch_));
    }
    std::vector<std::vector<uint32_t>> got(n_, std::vector<uint32_t>(nwords_));
    std::vector<size_t> stale;
    bool retried = false;
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      const uint64_t* src = push ? ll(rank_, p) : ll(p, p);
      stale.clear();
      for (size_t i = 0; i < nwords_; ++i) {
        uint64_t w = LoadRelaxed(&src[i]);
        if (LLEpoch(w) == epoch_) got[p][i] = LLData(w);
        else stale.push_back(i);
      }
      if (stale.empty()) continue;
      if (!retried) Count(kRetries), retried = true;
      bool ok = SpinUntil([&] {
        size_t keep = 0;
        for (size_t i : stale) {
          uint64_t w = LoadRelaxed(&src[i]);
          if (LLEpoch(w) == epoch_) got[p][i] = LLData(w);
          else stale[keep++] = i;
        }
        stale.resize(keep);
        return keep == 0;
      });
      if (!ok) throw Timeout{p};
    }
    for (int r = 0; r < n_; ++r)
      Accumulate(elem_, r == rank_ ? in_ : got[r].data(), nwords_, acc_.data(), r == 0);
    Store(elem_, acc_.data(), nwords_, out_);
  }

  ffi::Error Run() {
    Control* c = ctl(rank_);
    if (LoadRelaxed(&c->failed)) return FailedError(comm_);
    if (LoadRelaxed(&c->drop)) {  // testing.drop_rank: never arrive
      std::memcpy(out_, in_, nwords_ * 4);
      return ffi::Error::Success();
    }
    epoch_ = NextEpoch(epochs()[0]);  // CPU rank = one block: block 0's epoch
    epochs()[0] = epoch_;
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::nanoseconds(LoadRelaxed(&c->timeout_ns));
    uint32_t skew = SkewNs(LoadRelaxed(&c->skew_max_ns), LoadRelaxed(&c->skew_seed), rank_, epoch_);
    if (skew) std::this_thread::sleep_for(std::chrono::nanoseconds(skew));
    deadline_ += std::chrono::nanoseconds(skew);
    try {
      switch (algorithm_) {
        case kOneshot: Oneshot(true); break;
        case kOneshotDB: Oneshot(false); break;
        case kTwoshot: Twoshot(); break;
        case kSifarFlag: SifarFlag(); break;
        case kSifar: Sifar(false); break;
        case kSifarPush: Sifar(true); break;
        default:
          return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                            "sifar_jax: algorithm " + std::to_string(algorithm_) +
                                " has no CPU implementation");
      }
    } catch (const Timeout& t) {
      Count(kTimeouts);
      RecordFailure(t.peer);
      return FailedError(comm_);
    }
    Count(kCalls);
    return ffi::Error::Success();
  }

  // First failure wins the error record; every rank of the group fails fast.
  void RecordFailure(int peer) {
    ErrorRecord* e = grp_.errors[rank_];
    uint32_t expected = 0;
    if (__atomic_compare_exchange_n(&ctl(rank_)->error_claimed, &expected, 1u, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
      e->algorithm = algorithm_;
      e->rank = rank_;
      e->peer = peer;
      e->epoch = epoch_;
      e->block = 0;
      __atomic_store_n(&e->failed, 1u, __ATOMIC_RELEASE);
    }
    for (int r = 0; r < n_; ++r) __atomic_store_n(&ctl(r)->failed, 1u, __ATOMIC_RELEASE);
  }

 private:
  Comm& comm_;
  const WorkspaceLayout& lay_;
  const Group& grp_;
  int rank_, n_, algorithm_;
  Elem elem_;
  const uint32_t* in_;
  uint32_t* out_;
  size_t nwords_;
  char* const* slots_;  // explicit buffers (every rank's), or null
  std::vector<float> acc_;
  uint32_t epoch_ = 0;
  std::chrono::steady_clock::time_point deadline_;
};

ffi::Error RunCpu(int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer>& y,
                  int32_t axis_key, int32_t nranks, int32_t algorithm, int32_t repeat,
                  const ffi::AnyBuffer* buf) {
  Elem elem;
  switch (x.element_type()) {
    case ffi::DataType::F32: elem = Elem::kF32; break;
    case ffi::DataType::BF16: elem = Elem::kBf16; break;
    case ffi::DataType::F16: elem = Elem::kF16; break;
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "sifar_jax: only float32, bfloat16 and float16 are supported");
  }
  RankRef ref = Registry::Get().Lookup(axis_key, ordinal);
  if (ref.comm == nullptr) return NotInitialisedError(axis_key, ordinal);
  ffi::Error err = CheckPayload(*ref.comm, nranks, x.size_bytes(), y->size_bytes());
  if (err.failure()) return err;
  char* slots[kMaxRanks] = {};
  if (buf != nullptr) {
    err = ResolveBuffer(*ref.comm, ref.group, ref.rank, buf->untyped_data(), buf->size_bytes(),
                        slots);
    if (err.failure()) return err;
  }
  // repeat > 1: back-to-back all-reduces of the same input in one call (the
  // kernel-level benchmark); every one is a full call with its own epoch.
  for (int32_t i = 0; i < std::max(repeat, 1); ++i) {
    RankCall call(*ref.comm, ref.group, ref.rank, algorithm, elem,
                  static_cast<const uint32_t*>(x.untyped_data()),
                  static_cast<uint32_t*>(y->untyped_data()), x.size_bytes() / 4,
                  buf != nullptr ? slots : nullptr);
    err = call.Run();
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error CpuAllReduceImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::RemainingArgs /*after*/,
                            ffi::Result<ffi::AnyBuffer> y,
                            int32_t axis_key, int32_t nranks, int32_t algorithm, int32_t repeat) {
  return RunCpu(ordinal, x, y, axis_key, nranks, algorithm, repeat, nullptr);
}

ffi::Error CpuAllReduceIntoImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer buf,
                                ffi::AnyBuffer /*prev*/, ffi::RemainingArgs /*after*/,
                                ffi::Result<ffi::AnyBuffer> y,
                                ffi::Result<ffi::AnyBuffer> /*buf_out: aliases buf*/,
                                int32_t axis_key, int32_t nranks, int32_t algorithm,
                                int32_t repeat) {
  return RunCpu(ordinal, x, y, axis_key, nranks, algorithm, repeat, &buf);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuAllReduceInto, CpuAllReduceIntoImpl,
                              WithAllReduceAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()  // "after": ordering only, never read
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuAllReduce, CpuAllReduceImpl,
                              WithAllReduceAttrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  // "after": the previous all-reduce's result,
                                  // never read; the buffer dependence makes
                                  // XLA run the calls in trace order.
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()));

}  // namespace sifar
