// Where a step across devices (llama_step_tp.h) begins on its lane, given the per-block
// epochs the lane's plain all-reduces left: shared by the CUDA kernel (devices_phase.cuh) and
// the CPU backend (llama_step_tp.cc, which has one epoch a lane: one block), and compiled
// alone by a test (tests/sifar_jax/test_step_across_devices.py). Plain data and arithmetic.
//
// The plain all-reduce keeps an epoch per protocol block, and a call advances only the
// blocks it launches (BlocksFor its size). A step is a call of every block at once: it
// continues from block 0's epoch e0 (every call of the lane has a block 0) and, at its end,
// stores its last epoch into all of them. Two rules make that safe where other blocks lag
// behind block 0 (docs/step_across_devices.md, "Lagging protocol blocks"):
//   F1, the slot. The first phase writes slot NextEpoch(e0) & 1 of the lines it covers
//     before any barrier across the ranks. A block of the lane's last plain kernel may still
//     read those lines on a peer; it reads slot e_b & 1, where e_b is its epoch. Where a block
//     of those lines has the other parity than e0 (it lags by an odd count), the step first
//     passes a barrier across the ranks: every peer has then left its earlier kernels.
//   F2, the tag. Block 0 may have crossed the tag's wrap in a plain call that did not launch
//     block b: that call cleared block 0's lines only, and block b's old words could match a
//     tag of the new cycle. Where a block's epoch lies in another tag cycle than the step's
//     start, the step clears the whole tagged region of both slots (and the flags) between
//     two barriers across the ranks before anything is published, as at a wrap.
// Either way the step skips two epochs (s1, s2), which give the barriers fresh values
// (BarrierValue(s1, top), BarrierValue(s2, top): past every value block 0's barrier words
// held) and keep the first phase's slot parity e0 + 1's. The epochs are the same on every rank
// (every rank runs the same calls of the lane), so every rank takes the same decision.
// Without a lag (every block at e0, e.g. steps back to back) nothing changes: no barrier.
#pragma once

#include <cstdint>

#include "core/protocol.h"

namespace sifar {
namespace step {

struct LaneStart {
  uint32_t epoch;    // the epoch before phase 1 (phase 1 is NextEpoch(epoch))
  bool barrier;      // a barrier across the ranks at barrier_value before phase 1 publishes
  bool clear;        // ... then the tagged words and flags zeroed, then one at clear_value
  uint32_t barrier_value, clear_value;
};

// The protocol blocks whose lines of slot e & 1 one phase writes: sifar one 8-byte tagged word
// a row (2 a 16-byte line), oneshot one bf16 partial a row (8 a line); kLinesPerBlock lines a
// block (BlockOfLine, the same for every kernel of the lane).
SIFAR_HD int StepBlocksWritten(int hidden, int algorithm) {
  const size_t rows_per_line = algorithm == kOneshot ? 8 : 2;
  return BlocksFor((static_cast<size_t>(hidden) + rows_per_line - 1) / rows_per_line,
                   kLinesPerBlock);
}

// Whether epochs a and b lie in different tag cycles (a wrap lies between them).
SIFAR_HD bool OtherTagCycle(uint32_t a, uint32_t b, uint32_t mask) {
  return ((a ^ b) & ~mask) != 0;
}

// epochs: the lane's epochs of protocol blocks [0, nblocks) (the CPU: 1); written: the blocks
// phase 1 writes (StepBlocksWritten); mask: the tag's epoch bits (EpochMask).
SIFAR_HD LaneStart StepLaneStart(const uint32_t* epochs, int nblocks, int written,
                                 uint32_t mask) {
  const uint32_t e0 = epochs[0];
  bool parity = false, cycle = false;
  for (int b = 1; b < nblocks; ++b) {
    if (b < written && SlotParity(epochs[b]) != SlotParity(e0)) parity = true;
    if (OtherTagCycle(epochs[b], e0, mask)) cycle = true;
  }
  LaneStart s{e0, false, false, 0, 0};
  if (!parity && !cycle) return s;
  const uint32_t s1 = NextEpoch(e0, mask), s2 = NextEpoch(s1, mask);
  s.epoch = s2;
  s.barrier = true;
  s.barrier_value = BarrierValue(s1, kTop);
  // A lagging block lies in e0's cycle or an earlier one; s2 in e0's or a later one.
  s.clear = cycle || OtherTagCycle(s2, e0, mask);
  s.clear_value = s.clear ? BarrierValue(s2, kTop) : 0;
  return s;
}

}  // namespace step
}  // namespace sifar
