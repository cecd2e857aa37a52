// The step across devices (llama_step_tp.h): its checks and the communicator's pointers
// (PlanLlamaStepTp: both backends run them), and its CPU backend: each XLA:CPU host device
// runs llama_step.cc's reference on its shard on its own thread, and the all-reduce phases run
// the protocol across the host devices through the communicator's shared workspaces, by the
// rules the CUDA kernel follows (tagged words of the lane's epochs in dual slots, or oneshot's
// barriers), as cpu_allreduce.cc runs the plain all-reduce: a CPU rank behaves like one block.
#include "step/llama_step_tp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/cpu_numbers.h"
#include "runtime/comm.h"
#include "step/lane_start.h"
#include "targets.h"

namespace ffi = xla::ffi;

namespace sifar {
namespace step {

namespace {

// The pointers of rank `rank` of the call's group, `errors` its error records (host or
// kernel view).
StepComm MakeStepComm(const RankCall& c, const std::vector<ErrorRecord*>& errors) {
  const Comm& comm = *c.comm;
  const Group& g = comm.group(c.group);
  const WorkspaceLayout& lay = comm.layout();
  StepComm m;
  m.rank = c.rank;
  m.nranks = comm.nranks();
  m.algorithm = c.algorithm;
  m.chain = c.chain;
  for (int p = 0; p < m.nranks; ++p) {
    char* lane = g.workspaces[p] + c.lane_at;
    for (int parity = 0; parity < 2; ++parity) {
      char* slot = lane + lay.lane.slots + parity * lay.slot.total;
      m.words[parity][p] = reinterpret_cast<uint64_t*>(slot + lay.slot.ll +
                                                       p * LLRegionBytes(lay.slot.slot_bytes));
      m.plain[parity][p] = reinterpret_cast<uint16_t*>(slot + lay.slot.plain);
      if (p == c.rank) {
        m.own_ll[parity] = reinterpret_cast<uint64_t*>(slot + lay.slot.ll);
        m.own_flags[parity] = reinterpret_cast<uint32_t*>(slot + lay.slot.flags);
      }
    }
    m.barrier[p] = reinterpret_cast<uint64_t*>(lane + lay.lane.barrier);  // block 0's row
    m.ctl[p] = reinterpret_cast<Control*>(g.workspaces[p] + lay.control);
  }
  m.ll_words = static_cast<size_t>(m.nranks) * LLRegionBytes(lay.slot.slot_bytes) / 8;
  char* own_lane = g.workspaces[c.rank] + c.lane_at;
  m.epochs = reinterpret_cast<uint32_t*>(own_lane + lay.lane.epochs);
  m.calls = reinterpret_cast<uint64_t*>(own_lane + lay.lane.calls);
  m.stats = reinterpret_cast<unsigned long long*>(g.workspaces[c.rank] + lay.stats);
  m.err = errors[c.rank];
  return m;
}

}  // namespace

ffi::Error PlanLlamaStepTp(int ordinal, ffi::RemainingArgs args, ffi::AnyBuffer h,
                           ffi::AnyBuffer cache, ffi::AnyBuffer work, ffi::AnyBuffer logits,
                           const StepAttrs& attrs, const TpAttrs& tp, StepCall* call,
                           RankCall* rc, StepComm* m, bool device, bool in_run_order) {
  const std::string name = "llama_step across devices: ";
  if (tp.algorithm != kSifar && tp.algorithm != kOneshot)
    return Invalid(name + "the all-reduce phase is sifar or oneshot, not '" +
                   AlgorithmName(tp.algorithm) + "'");
  if (tp.nranks < 2 || tp.nranks > kMaxRanks)
    return Invalid(name + "2.." + std::to_string(kMaxRanks) + " ranks, got " +
                   std::to_string(tp.nranks));
  if (tp.after < 0 || static_cast<size_t>(tp.after) > args.size())
    return Invalid(name + "after must count the trailing ordering operands");
  if (args.size() < 1) return Invalid(name + "no operands");
  ffi::AnyBuffer x = args.get<ffi::AnyBuffer>(0).value();
  // The communicator, its traced size, a failure of the group (x and h: [H] bf16 alike).
  ffi::Error err = PlanCall(ordinal, x, h, nullptr, tp.axis_key, tp.nranks, tp.algorithm, 1,
                            tp.chain, rc, in_run_order);
  if (err.failure()) return err;
  err = PlanLlamaStep(args, h, cache, work, logits, attrs, call, args.size() - tp.after,
                      tp.nranks);
  if (err.failure()) return err;
  const size_t need = 4 * static_cast<size_t>(call->shape.hidden);
  if (need > rc->comm->slot_bytes())
    return Invalid(name + "the tagged words of H=" + std::to_string(call->shape.hidden) +
                   " rows need a slot of " + std::to_string(need) + " bytes (one 8-byte word a "
                   "row), the communicator's is " + std::to_string(rc->comm->slot_bytes()) +
                   ": sifar_jax.init(mesh, slot_bytes=" + std::to_string(need) + ") or more");
  const Group& g = rc->comm->group(rc->group);
  *m = MakeStepComm(*rc, device ? g.errors_device : g.errors);
  return ffi::Error::Success();
}

std::string DescribeStepFailure(const Comm& comm) {
  std::string msg = DescribeFailure(comm);
  ErrorRecord e;
  int group = 0;
  if (msg.empty() || !comm.FirstError(&e, &group) || e.pad == 0) return msg;
  const std::string lib = "sifar_jax: ";
  if (msg.compare(0, lib.size(), lib) == 0) msg = msg.substr(lib.size());
  const uint32_t k = e.pad;
  return lib + "llama_step's all-reduce of phase " + std::to_string(k) + " (layer " +
         std::to_string((k - 1) / 2) + "'s " + (k % 2 ? "o" : "down") + ") failed: " + msg;
}

namespace {

using cpu::Bf16ToF32;
using cpu::F32ToBf16;

template <typename T>
T LoadRelaxed(const T* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
template <typename T>
void StoreRelaxed(T* p, T v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

struct Timeout {
  int peer;
};

// One rank's all-reduce phases of one step on the CPU. The tagged words are stored with
// release and loaded with acquire (free on x86): a reader's loads of phase e's words happen
// before its own publication of a later phase, which a writer acquires before it writes slot
// e & 1 again (the dual-buffer argument, docs/step_across_devices.md).
class CpuStepRank final : public CpuAcross {
 public:
  CpuStepRank(const StepComm& m, uint32_t* status) : m_(m), status_(status) {}

  Control* ctl(int r) const { return m_.ctl[r]; }

  // The rank's start: false when the communicator has failed (the caller fills NaN).
  bool Start() {
    const Control* c = ctl(m_.rank);
    if (LoadRelaxed(&c->failed)) return false;
    mask_ = EpochMask(LoadRelaxed(&c->epoch_mask));
    timeout_ = std::chrono::nanoseconds(LoadRelaxed(&c->timeout_ns));
    skew_max_ = LoadRelaxed(&c->skew_max_ns);
    skew_seed_ = LoadRelaxed(&c->skew_seed);
    // One epoch a lane on the CPU (cpu_allreduce.cc keeps block 0's): the lane's start rule
    // (lane_start.h) over one block never finds a lagging one.
    epoch_ = StepLaneStart(m_.epochs, 1, 1, mask_).epoch;
    return true;
  }
  bool dropped() const { return LoadRelaxed(&ctl(m_.rank)->drop) != 0; }

  void Reduce(int k, const std::vector<float>& mine, std::vector<float>* sum) override {
    const size_t H = mine.size();
    sum->assign(H, NAN);
    if (failed_) return;  // a phase of this step failed: the later ones give up at once
    const uint32_t prev = epoch_;
    epoch_ = NextEpoch(epoch_, mask_);
    tag_ = Tag(ChainTag(m_.chain), epoch_, mask_);
    retried_ = false;
    try {
      deadline_ = std::chrono::steady_clock::now() + timeout_;
      if (WrapsAt(prev, epoch_)) ClearAtWrap();
      const uint32_t skew = SkewNs(skew_max_, skew_seed_, m_.rank, epoch_);
      if (skew) std::this_thread::sleep_for(std::chrono::nanoseconds(skew));
      deadline_ = std::chrono::steady_clock::now() + timeout_;
      if (m_.algorithm == kOneshot) Oneshot(mine, sum);
      else Sifar(mine, sum);
    } catch (const Timeout& t) {
      Fail(k, t.peer);
      sum->assign(H, NAN);
      return;
    }
    ++phases_;
    if (retried_) {
      ++retried_phases_;
      if (status_) ++status_[kRetried];
    }
  }

  // After the step: the lane's epochs (every protocol block's: the step ran the lane's calls
  // of all of them) and counts, unless a phase failed (the communicator is failed then).
  void Commit() {
    if (failed_ || phases_ == 0) return;
    for (int b = 0; b < kMaxBlocks; ++b) m_.epochs[b] = epoch_;
    m_.calls[m_.algorithm] += static_cast<uint64_t>(phases_);
    if (retried_phases_)
      __atomic_fetch_add(&m_.stats[m_.algorithm * kNumStats + kRetries],
                         static_cast<unsigned long long>(retried_phases_), __ATOMIC_RELAXED);
  }

 private:
  // Waits until pred() holds; throws Timeout{peer} past the deadline or once another rank
  // has failed the communicator. Yields: 8 ranks share 2 cores.
  template <typename Pred>
  void SpinUntil(int peer, Pred pred) {
    for (uint64_t i = 0;; ++i) {
      if (pred()) return;
      if ((i & 15) == 0 && (LoadRelaxed(&ctl(m_.rank)->failed) ||
                            std::chrono::steady_clock::now() > deadline_))
        throw Timeout{peer};
      if (i < 256) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Every rank has arrived at `value` (block 0's barrier words, BarrierReached's rule).
  void BarrierAt(uint32_t value) {
    const uint32_t chain = ChainTag(m_.chain);
    for (int p = 0; p < m_.nranks; ++p)
      if (p != m_.rank)
        __atomic_store_n(&m_.barrier[p][m_.rank], BarrierWord(chain, value), __ATOMIC_RELEASE);
    for (int p = 0; p < m_.nranks; ++p) {
      if (p == m_.rank) continue;
      const uint64_t* f = &m_.barrier[m_.rank][p];
      SpinUntil(p, [&] { return BarrierReached(__atomic_load_n(f, __ATOMIC_ACQUIRE), chain, value); });
    }
  }

  // The tag wrap: between barriers on the two skipped epochs' values, this rank's tagged
  // words (every source region) and flags of both slots are zeroed, for every protocol block.
  void ClearAtWrap() {
    BarrierAt(BarrierValue(epoch_ - 2, kTop));
    for (int parity = 0; parity < 2; ++parity) {
      for (size_t i = 0; i < m_.ll_words; ++i) StoreRelaxed(&m_.own_ll[parity][i], uint64_t{0});
      for (int b = 0; b < kMaxBlocks; ++b) StoreRelaxed(&m_.own_flags[parity][b], uint32_t{0});
    }
    BarrierAt(BarrierValue(epoch_ - 1, kTop));
  }

  // sum <- the rank-order float32 sum of every rank's partials (own ones as they are).
  void Add(const std::vector<std::vector<float>>& got, const std::vector<float>& mine,
           std::vector<float>* sum) {
    for (int p = 0; p < m_.nranks; ++p) {
      const std::vector<float>& v = p == m_.rank ? mine : got[p];
      for (size_t j = 0; j < mine.size(); ++j) (*sum)[j] = p == 0 ? v[j] : (*sum)[j] + v[j];
    }
  }

  void Sifar(const std::vector<float>& mine, std::vector<float>* sum) {
    const size_t H = mine.size();
    const uint32_t parity = SlotParity(epoch_);
    uint64_t* out = m_.words[parity][m_.rank];
    for (size_t j = 0; j < H; ++j)
      __atomic_store_n(&out[j], PackLL(F32ToBf16(mine[j]), tag_), __ATOMIC_RELEASE);
    std::vector<std::vector<float>> got(m_.nranks, std::vector<float>(H));
    std::vector<size_t> stale;
    for (int p = 0; p < m_.nranks; ++p) {
      if (p == m_.rank) continue;
      const uint64_t* src = m_.words[parity][p];
      auto take = [&](size_t j) {
        const uint64_t w = __atomic_load_n(&src[j], __ATOMIC_ACQUIRE);
        if (LLTag(w) != tag_) return false;
        got[p][j] = Bf16ToF32(static_cast<uint16_t>(LLData(w)));
        return true;
      };
      stale.clear();
      for (size_t j = 0; j < H; ++j)
        if (!take(j)) stale.push_back(j);
      if (stale.empty()) continue;
      retried_ = true;
      SpinUntil(p, [&] {
        size_t keep = 0;
        for (size_t j : stale)
          if (!take(j)) stale[keep++] = j;
        stale.resize(keep);
        return keep == 0;
      });
    }
    Add(got, mine, sum);
  }

  void Oneshot(const std::vector<float>& mine, std::vector<float>* sum) {
    const size_t H = mine.size();
    const uint32_t parity = SlotParity(epoch_);
    uint16_t* out = m_.plain[parity][m_.rank];
    for (size_t j = 0; j < H; ++j) StoreRelaxed(&out[j], F32ToBf16(mine[j]));
    BarrierAt(BarrierValue(epoch_, kTop));
    std::vector<std::vector<float>> got(m_.nranks, std::vector<float>(H));
    for (int p = 0; p < m_.nranks; ++p)
      if (p != m_.rank)
        for (size_t j = 0; j < H; ++j) got[p][j] = Bf16ToF32(LoadRelaxed(&m_.plain[parity][p][j]));
    Add(got, mine, sum);
    BarrierAt(BarrierValue(epoch_, kBottom));
  }

  // The first failure of this rank fills its error record (the phase in `pad`); every rank of
  // the group is told to fail fast; the step's status words say it too.
  void Fail(int k, int peer) {
    failed_ = true;
    __atomic_fetch_add(&m_.stats[m_.algorithm * kNumStats + kTimeouts], 1ull, __ATOMIC_RELAXED);
    uint32_t expected = 0;
    if (__atomic_compare_exchange_n(&ctl(m_.rank)->error_claimed, &expected, 1u, false,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      ErrorRecord* e = m_.err;
      e->algorithm = m_.algorithm;
      e->rank = m_.rank;
      e->peer = peer;
      e->epoch = epoch_;
      e->block = 0;
      e->chain = m_.chain;
      e->pad = static_cast<uint32_t>(k);
      __atomic_store_n(&e->failed, 1u, __ATOMIC_RELEASE);
    }
    for (int r = 0; r < m_.nranks; ++r) __atomic_store_n(&ctl(r)->failed, 1u, __ATOMIC_RELEASE);
    if (status_ && !status_[kFailed]) {
      status_[kFailed] = 1;
      status_[kFailedPhase] = static_cast<uint32_t>(k);
      status_[kMissingRank] = static_cast<uint32_t>(peer < 0 ? 0 : peer);
      status_[kFailedBlock] = 0;
    }
  }

  const StepComm& m_;
  uint32_t* status_;
  uint32_t mask_ = kEpochTagMask, epoch_ = 0, tag_ = 0, skew_max_ = 0, skew_seed_ = 0;
  std::chrono::nanoseconds timeout_{0};
  std::chrono::steady_clock::time_point deadline_;
  bool failed_ = false, retried_ = false;
  int phases_ = 0, retried_phases_ = 0;
};

void FillNaN(const StepCall& c) {
  for (int j = 0; j < c.shape.hidden; ++j) c.h[j] = F32ToBf16(NAN);
  for (int r = 0; r < c.vocab; ++r) c.logits[r] = NAN;
}

ffi::Error CpuLlamaStepTpImpl(int32_t ordinal, ffi::RemainingArgs args,
                              ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> cache,
                              ffi::Result<ffi::AnyBuffer> work,
                              ffi::Result<ffi::AnyBuffer> logits, int64_t layers,
                              int64_t kv_heads, int64_t group, float eps, int64_t after,
                              int32_t axis_key, int32_t nranks, int32_t algorithm,
                              int32_t repeat, int32_t chain) {
  StepCall call;
  RankCall rc;
  StepComm m;
  const StepAttrs attrs{layers, kv_heads, group, eps, 1, algorithm == kOneshot, kMaxTimeoutNs,
                        0, -1};
  const TpAttrs tp{axis_key, nranks, algorithm, repeat, chain, after};
  ffi::Error err = PlanLlamaStepTp(ordinal, args, *h, *cache, *work, *logits, attrs, tp, &call,
                                   &rc, &m, /*device=*/false);
  if (err.failure()) return err;
  const int pos = call.pos[0], start = call.pos[1];
  if (pos < 0 || pos >= call.shape.capacity || start < 0 || start > pos)
    return Invalid("llama_step: slot " + std::to_string(pos) + " (first slot " +
                   std::to_string(start) + ") outside the cache's " +
                   std::to_string(call.shape.capacity) + " slots");
  if (call.cache != call.cache_in) std::memcpy(call.cache, call.cache_in, call.cache_bytes);
  uint32_t* status = reinterpret_cast<uint32_t*>(call.work + call.ws.status);
  std::fill(status, status + kStatusWords, 0u);
  CpuStepRank rank(m, status);
  if (!rank.Start()) {  // the communicator failed earlier: never a plausible number
    FillNaN(call);
    return FailedError(*rc.comm);
  }
  if (rank.dropped()) {  // testing.drop_rank: this rank never arrives
    FillNaN(call);
    return ffi::Error::Success();
  }
  RunCpuLlamaStep(call, &rank);
  rank.Commit();
  // A failed phase leaves NaN in h and the logits and the failure in the error records, which
  // sifar_jax.check() reports (and the next call on the communicator returns as an error).
  return ffi::Error::Success();
}

}  // namespace
}  // namespace step

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuLlamaStepTp, step::CpuLlamaStepTpImpl,
                              WithLlamaStepTpOperands(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>()));

}  // namespace sifar
