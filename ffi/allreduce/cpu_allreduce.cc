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

#include "allreduce/plan.h"
#include "core/cpu_numbers.h"
#include "core/protocol.h"
#include "runtime/comm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace {

using cpu::HalfToF32;
using cpu::F32ToHalf;

// ----------------------------------------------------------------- numbers --
// Adds the elements held in `words` to acc (acc = first ? x : acc + x), in
// fp32 (integers: exact 32-bit two's-complement sums, kept in acc's bits).
void Accumulate(Elem t, const uint32_t* words, size_t nwords, float* acc, bool first) {
  if (t == Elem::kU32) {
    for (size_t i = 0; i < nwords; ++i) {
      uint32_t a;
      std::memcpy(&a, &acc[i], 4);
      a = first ? words[i] : a + words[i];
      std::memcpy(&acc[i], &a, 4);
    }
    return;
  }
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
    float a = HalfToF32(t, lo);
    float b = HalfToF32(t, hi);
    acc[2 * i] = first ? a : acc[2 * i] + a;
    acc[2 * i + 1] = first ? b : acc[2 * i + 1] + b;
  }
}

// Rounds once to the payload type.
void Store(Elem t, const float* acc, size_t nwords, uint32_t* out) {
  if (t == Elem::kF32 || t == Elem::kU32) {
    std::memcpy(out, acc, nwords * 4);
    return;
  }
  for (size_t i = 0; i < nwords; ++i) {
    uint16_t a = F32ToHalf(t, acc[2 * i]);
    uint16_t b = F32ToHalf(t, acc[2 * i + 1]);
    out[i] = static_cast<uint32_t>(a) | (static_cast<uint32_t>(b) << 16);
  }
}

// Accumulator floats per 32-bit word.
size_t AccPerWord(Elem t) { return t == Elem::kBf16 || t == Elem::kF16 ? 2 : 1; }

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

// One rank's view of one all-reduce call: a CPU rank behaves like a single
// thread block (block 0's epochs, every line).
class CpuRank {
 public:
  explicit CpuRank(const RankCall& c)
      : call_(c),
        comm_(*c.comm),
        lay_(c.comm->layout()),
        grp_(c.comm->group(c.group)),
        rank_(c.rank),
        n_(c.comm->nranks()),
        in_(static_cast<const uint32_t*>(c.in)),
        out_(static_cast<uint32_t*>(c.out)),
        nwords_(c.nbytes / 4),
        acc_(nwords_ * AccPerWord(c.elem)) {}

  char* ws(int r) const { return grp_.workspaces[r]; }
  char* lane(int r) const { return ws(r) + call_.lane_at; }
  Control* ctl(int r) const { return reinterpret_cast<Control*>(ws(r) + lay_.control); }
  uint32_t* epochs() const { return reinterpret_cast<uint32_t*>(lane(rank_) + lay_.lane.epochs); }
  uint64_t* barrier(int r) const { return reinterpret_cast<uint64_t*>(lane(r) + lay_.lane.barrier); }
  unsigned long long* stats() const {
    return reinterpret_cast<unsigned long long*>(ws(rank_) + lay_.stats);
  }
  // This lane's count of completed calls per algorithm (the kernels' rule).
  uint64_t* lane_calls() const {
    return reinterpret_cast<uint64_t*>(lane(rank_) + lay_.lane.calls);
  }
  TraceRing* trace() const { return reinterpret_cast<TraceRing*>(ws(rank_) + lay_.trace); }
  // The internal slot of a parity, or the user's buffer.
  char* slot_of(int r, uint32_t parity) const {
    return call_.explicit_buffers ? call_.slots[r]
                                  : lane(r) + lay_.lane.slots + parity * lay_.slot.total;
  }
  char* slot(int r) const { return slot_of(r, SlotParity(epoch_)); }
  uint32_t* plain(int r) const { return reinterpret_cast<uint32_t*>(slot(r) + lay_.slot.plain); }
  uint32_t* tmp(int r) const { return reinterpret_cast<uint32_t*>(slot(r) + lay_.slot.tmp); }
  // Epoch-tagged words from rank `src`, in rank `owner`'s slot.
  uint64_t* ll_of(int owner, int src, uint32_t parity) const {
    return reinterpret_cast<uint64_t*>(slot_of(owner, parity) + lay_.slot.ll +
                                       src * LLRegionBytes(lay_.slot.slot_bytes));
  }
  uint64_t* ll(int owner, int src) const { return ll_of(owner, src, SlotParity(epoch_)); }
  uint32_t* flag(int r) const { return reinterpret_cast<uint32_t*>(slot(r) + lay_.slot.flags); }

  void Count(int field) {
    __atomic_fetch_add(&stats()[call_.algorithm * kNumStats + field], 1ull, __ATOMIC_RELAXED);
  }

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

  // Every rank has written `value` of this chain (BarrierReached's rule).
  void BarrierAt(uint32_t value) {
    const uint32_t chain = ChainTag(call_.chain);
    for (int p = 0; p < n_; ++p)
      if (p != rank_)
        __atomic_store_n(&barrier(p)[rank_], BarrierWord(chain, value), __ATOMIC_RELEASE);
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      const uint64_t* f = &barrier(rank_)[p];
      if (!SpinUntil([&] {
            return BarrierReached(__atomic_load_n(f, __ATOMIC_ACQUIRE), chain, value);
          }))
        throw Timeout{p};
    }
  }
  void Barrier(uint32_t phase) { BarrierAt(BarrierValue(epoch_, phase)); }

  // The tag wrap: between two barriers on the skipped epochs' values, zero
  // this rank's tagged words and flags in both slots, over the whole slot.
  void ClearTaggedAtWrap() {
    BarrierAt(BarrierValue(epoch_ - 2, kTop));
    const size_t words = lay_.slot.slot_bytes / 4;  // tagged words per source region
    for (uint32_t parity = 0; parity < 2; ++parity) {
      for (int src = 0; src < n_; ++src) {
        uint64_t* region = ll_of(rank_, src, parity);
        for (size_t i = 0; i < words; ++i) StoreRelaxed(&region[i], uint64_t{0});
      }
      StoreRelaxed(reinterpret_cast<uint32_t*>(slot_of(rank_, parity) + lay_.slot.flags),
                   uint32_t{0});
    }
    BarrierAt(BarrierValue(epoch_ - 1, kTop));
  }

  // acc <- sum over ranks 0..N-1 of words[r][begin:end), own rank from `in_`.
  void ReduceFrom(const std::vector<const uint32_t*>& words, size_t begin, size_t end) {
    const size_t k = end - begin;
    const size_t per = AccPerWord(call_.elem);
    std::vector<uint32_t> w(k);
    for (int r = 0; r < n_; ++r) {
      if (r == rank_) std::memcpy(w.data(), in_ + begin, k * 4);
      else CopyOut(w.data(), words[r] + begin, k);
      Accumulate(call_.elem, w.data(), k, acc_.data() + per * begin, r == 0);
    }
    Store(call_.elem, acc_.data() + per * begin, k, out_ + begin);
  }

  std::vector<const uint32_t*> Peers(uint32_t* (CpuRank::*region)(int) const) const {
    std::vector<const uint32_t*> v(n_);
    for (int r = 0; r < n_; ++r) v[r] = (this->*region)(r);
    return v;
  }

  void Oneshot(bool bottom_barrier) {
    CopyIn(plain(rank_), in_, nwords_);
    Barrier(kTop);
    ReduceFrom(Peers(&CpuRank::plain), 0, nwords_);
    if (bottom_barrier) Barrier(kBottom);
  }

  void Twoshot() {
    CopyIn(plain(rank_), in_, nwords_);
    Barrier(kTop);
    const size_t lines = nwords_ / 4;  // 16-byte lines, as on the GPU
    Piece mine = PieceOf(0, lines, rank_, n_);
    ReduceFrom(Peers(&CpuRank::plain), mine.begin * 4, mine.end * 4);
    CopyIn(tmp(rank_) + mine.begin * 4, out_ + mine.begin * 4, (mine.end - mine.begin) * 4);
    Barrier(kMid);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      Piece p = PieceOf(0, lines, q, n_);
      CopyOut(out_ + p.begin * 4, tmp(q) + p.begin * 4, (p.end - p.begin) * 4);
    }
    Barrier(kBottom);
  }

  // The paper's validation, made correct: publish the payload, then the flag
  // with release; acquire every peer's flag (equal to this call's tag: flags
  // are never ahead in this slot) and only then pull the payloads.
  void SifarFlag() {
    CopyIn(plain(rank_), in_, nwords_);
    __atomic_store_n(flag(rank_), tag_, __ATOMIC_RELEASE);
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      const uint32_t* f = flag(p);
      if (__atomic_load_n(f, __ATOMIC_ACQUIRE) == tag_) continue;
      retried_ = true;
      if (!SpinUntil([&] { return __atomic_load_n(f, __ATOMIC_ACQUIRE) == tag_; }))
        throw Timeout{p};
    }
    ReduceFrom(Peers(&CpuRank::plain), 0, nwords_);
  }

  // SiFAR: publish tagged words, pull every peer's words at once, re-read only
  // the words whose tag is stale.  No flag, no barrier.  With `push` the words
  // go into every peer's slot and each rank reads its own.
  void Sifar(bool push) {
    for (int p = 0; p < n_; ++p) {  // publish into our slot (pull) or every peer's (push)
      if (push ? p == rank_ : p != rank_) continue;
      uint64_t* dst = ll(p, rank_);
      for (size_t i = 0; i < nwords_; ++i) StoreRelaxed(&dst[i], PackLL(in_[i], tag_));
    }
    std::vector<std::vector<uint32_t>> got(n_, std::vector<uint32_t>(nwords_));
    std::vector<size_t> stale;
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      const uint64_t* src = push ? ll(rank_, p) : ll(p, p);
      stale.clear();
      for (size_t i = 0; i < nwords_; ++i) {
        uint64_t w = LoadRelaxed(&src[i]);
        if (LLTag(w) == tag_) got[p][i] = LLData(w);
        else stale.push_back(i);
      }
      if (stale.empty()) continue;
      retried_ = true;
      bool ok = SpinUntil([&] {
        size_t keep = 0;
        for (size_t i : stale) {
          uint64_t w = LoadRelaxed(&src[i]);
          if (LLTag(w) == tag_) got[p][i] = LLData(w);
          else stale[keep++] = i;
        }
        stale.resize(keep);
        return keep == 0;
      });
      if (!ok) throw Timeout{p};
    }
    for (int r = 0; r < n_; ++r)
      Accumulate(call_.elem, r == rank_ ? in_ : got[r].data(), nwords_, acc_.data(), r == 0);
    Store(call_.elem, acc_.data(), nwords_, out_);
  }

  // One body per portable algorithm of the table, an overload on Alg<id>;
  // RunBody<id> runs it (false: the row is not portable, no CPU body).
  void Body(Alg<kOneshot>) { Oneshot(true); }
  void Body(Alg<kOneshotDB>) { Oneshot(false); }
  void Body(Alg<kTwoshot>) { Twoshot(); }
  void Body(Alg<kSifarFlag>) { SifarFlag(); }
  void Body(Alg<kSifar>) { Sifar(false); }
  void Body(Alg<kSifarPush>) { Sifar(true); }
  template <int ALG>
  bool RunBody() {
    if constexpr (PortableAlgorithm(ALG)) {
      Body(Alg<ALG>{});
      return true;
    } else {
      return false;
    }
  }

  void FillFailed() { cpu::FillFailed(call_.elem, out_, nwords_ * 4); }

  // One all-reduce (repeat calls this `repeat` times).
  ffi::Error Run() {
    Control* c = ctl(rank_);
    if (LoadRelaxed(&c->failed)) {
      FillFailed();
      return FailedError(comm_);
    }
    if (LoadRelaxed(&c->drop) == 1) {  // testing.drop_rank from block 0: never arrive
      std::memcpy(out_, in_, nwords_ * 4);
      return ffi::Error::Success();
    }
    const auto start = std::chrono::steady_clock::now();
    const uint32_t mask = EpochMask(LoadRelaxed(&c->epoch_mask));
    const uint32_t prev = epochs()[0];
    epoch_ = NextEpoch(prev, mask);
    tag_ = Tag(ChainTag(call_.chain), epoch_, mask);
    deadline_ = start + std::chrono::nanoseconds(LoadRelaxed(&c->timeout_ns));
    uint32_t skew = SkewNs(LoadRelaxed(&c->skew_max_ns), LoadRelaxed(&c->skew_seed), rank_, epoch_);
    if (skew) std::this_thread::sleep_for(std::chrono::nanoseconds(skew));
    deadline_ += std::chrono::nanoseconds(skew);
    try {
      if (WrapsAt(prev, epoch_)) ClearTaggedAtWrap();
      bool ran = false;
      switch (call_.algorithm) {  // the table's bodies (protocol.h)
#define SIFAR_CPU_BODY(e, ...) \
  case e: ran = RunBody<e>(); break;
        SIFAR_ALGORITHMS(SIFAR_CPU_BODY)
#undef SIFAR_CPU_BODY
        default: break;
      }
      if (!ran)
        return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                          std::string("sifar_jax: algorithm '") +
                              AlgorithmName(call_.algorithm) + "' has no CPU implementation");
    } catch (const Timeout& t) {
      Count(kTimeouts);
      RecordFailure(t.peer);
      FillFailed();
      return FailedError(comm_);
    }
    epochs()[0] = epoch_;
    lane_calls()[call_.algorithm] += 1;  // like the epoch: only this lane's calls write it
    if (retried_) Count(kRetries);
    if (LoadRelaxed(&c->trace)) Record(start);
    return ffi::Error::Success();
  }

  // First failure wins the error record; every rank of the group fails fast.
  void RecordFailure(int peer) {
    ErrorRecord* e = grp_.errors[rank_];
    uint32_t expected = 0;
    if (__atomic_compare_exchange_n(&ctl(rank_)->error_claimed, &expected, 1u, false,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      e->algorithm = call_.algorithm;
      e->rank = rank_;
      e->peer = peer;
      e->epoch = epoch_;
      e->block = 0;
      e->chain = call_.chain;
      __atomic_store_n(&e->failed, 1u, __ATOMIC_RELEASE);
    }
    for (int r = 0; r < n_; ++r) __atomic_store_n(&ctl(r)->failed, 1u, __ATOMIC_RELEASE);
  }

  void Record(std::chrono::steady_clock::time_point start) {
    auto ns = [](std::chrono::steady_clock::time_point t) {
      return static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
    };
    TraceRing* ring = trace();
    const unsigned long long k = __atomic_fetch_add(&ring->next, 1ull, __ATOMIC_RELAXED);
    TraceRecord& r = ring->records[k % kTraceCapacity];
    r.start_ns = ns(start);
    r.end_ns = ns(std::chrono::steady_clock::now());
    r.epoch = epoch_;
    r.chain = call_.chain;
    r.algorithm = call_.algorithm;
    r.retried = retried_;
  }

 private:
  const RankCall& call_;
  Comm& comm_;
  const WorkspaceLayout& lay_;
  const Group& grp_;
  int rank_, n_;
  const uint32_t* in_;
  uint32_t* out_;
  size_t nwords_;
  std::vector<float> acc_;
  uint32_t epoch_ = 0, tag_ = 0;
  bool retried_ = false;
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace

ffi::Error RunCpuAllReduce(const RankCall& call) {
  if (call.nbytes == 0) return ffi::Error::Success();
  // repeat > 1: back-to-back all-reduces of the same input in one call (the
  // kernel-level benchmark); every one is a full call with its own epoch.
  for (int32_t i = 0; i < call.repeat; ++i) {
    ffi::Error err = CpuRank(call).Run();
    if (err.failure()) return err;
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error RunCpu(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer y, const ffi::AnyBuffer* buf,
                  int32_t axis_key, int32_t nranks, int32_t algorithm, int32_t repeat,
                  int32_t chain) {
  RankCall call;
  ffi::Error err = PlanCall(ordinal, x, y, buf, axis_key, nranks, algorithm, repeat, chain, &call);
  if (err.failure()) return err;
  return RunCpuAllReduce(call);
}

ffi::Error CpuAllReduceImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::RemainingArgs /*after*/,
                            ffi::Result<ffi::AnyBuffer> y, int32_t axis_key, int32_t nranks,
                            int32_t algorithm, int32_t repeat, int32_t chain) {
  return RunCpu(ordinal, x, *y, nullptr, axis_key, nranks, algorithm, repeat, chain);
}

ffi::Error CpuAllReduceIntoImpl(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer buf,
                                ffi::AnyBuffer /*prev*/, ffi::RemainingArgs /*after*/,
                                ffi::Result<ffi::AnyBuffer> y,
                                ffi::Result<ffi::AnyBuffer> /*buf_out: aliases buf*/,
                                int32_t axis_key, int32_t nranks, int32_t algorithm,
                                int32_t repeat, int32_t chain) {
  return RunCpu(ordinal, x, *y, &buf, axis_key, nranks, algorithm, repeat, chain);
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
