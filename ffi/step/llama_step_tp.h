// The Llama step across devices (TP >= 2, one rank per device): each device runs the step of
// llama_step.h on its shard (its KV heads: their qkv rows, their cache, their columns of o; its
// FFN rows: gate_up's rows, down's columns; its share of the LM head's vocabulary), and the
// all-reduce after o and after down is a phase of the step that reads the PEERS' partials
// through the communicator's memory (sifar_jax.init(mesh): P2P pointers between the GPUs of
// one process, CUDA IPC mappings between processes, shared host memory between the XLA:CPU
// host devices), not through another launch.
//
// The all-reduce phases are calls of the communicator's lane (the call chain's, as every
// sifar_psum of the program): phase k of a launch is the lane's next epoch e (protocol.h,
// NextEpoch), which persists in the workspace from launch to launch and from the step to the
// plain all-reduces of the lane (a zeroed workspace, after init, starts them all again):
//   sifar    rank r writes its bf16 partial of row n as the LL word PackLL(bits, Tag(chain, e))
//            at word n of its own tagged region in slot e & 1; every reader (every block of
//            every rank, itself too) loads the words of every rank and re-reads only those
//            whose tag is not exactly (chain, e): no flag, no barrier. One row per 8-byte word,
//            so the slot must hold 4 H bytes (a tagged region is 2 slot_bytes).
//   oneshot  the paper's baseline in a megakernel: the bf16 partials in the plain region of
//            slot e & 1, a barrier across the ranks (every block of every rank) before the
//            reads and one after (protocol block 0's barrier words, values BarrierValue(e, top)
//            and (e, bottom)).
// The dual-buffer rule across launches and why no stale or future word is accepted:
// docs/step_across_devices.md. The tag wrap clears as a plain call does (docs/design.md,
// "Epochs and wrap"), the whole tagged region of both slots, between two barriers across the
// ranks. Where the plain all-reduce's protocol blocks lag behind block 0 (GPUs: a call
// advances only the blocks it launches), the step begins two epochs on, behind a barrier
// across the ranks, and clears where a block lags into an earlier tag cycle (lane_start.h).
// Every wait is bounded by the communicator's timeout (at most kMaxTimeoutNs on GPUs);
// past it the rank records the failure in its error record (protocol.h's ErrorRecord, with
// the phase in its spare word `pad`: sifar_jax.check() names it), fails the communicator for
// every rank, and the missing values are NaN, which spreads to h and every logit from any
// phase but the last. testing.inject_skew delays every phase's publication (the per-(seed,
// rank, epoch) skew), testing.drop_rank makes a rank skip the step (h and logits NaN, nothing
// published: its peers time out).
#pragma once

#include <cstddef>
#include <cstdint>

#include "allreduce/plan.h"
#include "core/protocol.h"
#include "step/llama_step.h"
#include "xla/ffi/api/ffi.h"

namespace sifar {
namespace step {

// What a rank of the step across devices reaches of its communicator: pointers into every
// rank's workspace (the kernels' views on CUDA), filled by MakeStepComm. Plain data: the CUDA
// kernel takes it as an argument.
struct StepComm {
  int rank = 0, nranks = 1;
  int algorithm = kSifar;  // kSifar or kOneshot
  uint32_t chain = 0;      // the call chain (its tag bits: ChainTag)
  uint64_t* words[2][kMaxRanks] = {};  // sifar: rank p's tagged words, [H], in its slot `parity`
  uint16_t* plain[2][kMaxRanks] = {};  // oneshot: rank p's bf16 partials, [H], slot `parity`
  uint64_t* barrier[kMaxRanks] = {};   // rank p's barrier words of protocol block 0, [source]
  Control* ctl[kMaxRanks] = {};        // every rank's control record
  uint64_t* own_ll[2] = {};  // this rank's tagged words of slot `parity`, every source region
  uint32_t* own_flags[2] = {};  // ... and its flags (zeroed at the tag wrap)
  size_t ll_words = 0;          // 8-byte words of own_ll
  uint32_t* epochs = nullptr;   // this rank's lane epochs [kMaxBlocks]
  uint64_t* calls = nullptr;    // this rank's lane call counts [kNumAlgorithms]
  unsigned long long* stats = nullptr;  // this rank's [kNumAlgorithms][kNumStats]
  ErrorRecord* err = nullptr;   // this rank's failure record
};

// The op's attributes beyond StepAttrs (whose ranks is 1; kv_heads is this rank's shard):
// the all-reduce's (WithAllReduceAttrs: axis_key, nranks, algorithm, repeat, chain) and the
// count of ordering operands after the step's.
struct TpAttrs {
  int32_t axis_key, nranks, algorithm, repeat, chain;
  int64_t after;
};

// Every check of the step across devices, in one place for both backends: the communicator
// of this device on the axis (PlanCall's: traced size, a failed group), the algorithm (sifar or
// oneshot), a slot that holds the tagged words, this rank's shard (PlanLlamaStep with
// Shape::devices); fills *call, *rc (holding the communicator while the handler runs) and *m
// (`device`: the kernels' view of the error record).
xla::ffi::Error PlanLlamaStepTp(int ordinal, xla::ffi::RemainingArgs args, xla::ffi::AnyBuffer h,
                                xla::ffi::AnyBuffer cache, xla::ffi::AnyBuffer work,
                                xla::ffi::AnyBuffer logits, const StepAttrs& attrs,
                                const TpAttrs& tp, StepCall* call, RankCall* rc, StepComm* m,
                                bool device, bool in_run_order = true);

// DescribeFailure(comm), which a failure of the step's names: "sifar_jax: llama_step's
// all-reduce of phase 3 (layer 1's o) failed: all-reduce timed out on axis ..." when the first
// failure recorded on `comm` is a step's (ErrorRecord::pad holds its phase).
std::string DescribeStepFailure(const Comm& comm);

}  // namespace step

template <typename Binding>
auto WithLlamaStepTpOperands(Binding binding) {
  return WithAllReduceAttrs(
      std::move(binding)
          .RemainingArgs()  // llama_step's operands (this rank's shard), then "after" ones
          .template Ret<xla::ffi::AnyBuffer>()  // h [H] bf16
          .template Ret<xla::ffi::AnyBuffer>()  // the cache (aliases the cache operand)
          .template Ret<xla::ffi::AnyBuffer>()  // workspace (uint8)
          .template Ret<xla::ffi::AnyBuffer>()  // logits [V / ranks] f32 ([0] without a head)
          .template Attr<int64_t>("layers")
          .template Attr<int64_t>("kv_heads")  // this rank's
          .template Attr<int64_t>("group")
          .template Attr<float>("eps")
          .template Attr<int64_t>("after"));  // ordering operands after the step's
}

}  // namespace sifar
