// Launching one rank's all-reduce kernel: the CUDA FFI handler's path after
// its checks, shared with the test harness that runs several ranks on one GPU
// (each on its own stream).
#pragma once

#include <cuda_runtime.h>

#include "allreduce/plan.h"

namespace sifar {

// Enqueues `call`'s kernel on `stream` (no host synchronisation; CUDA-graph
// safe).  `call` comes from PlanCall, or is filled by hand by a test harness
// (comm, group, rank, elem, algorithm, repeat, chain, lane_at, in, out,
// nbytes, and optionally explicit slots).  Multicast is not launched here.
cudaError_t LaunchRankAllReduce(const RankCall& call, cudaStream_t stream);

// The fused all-reduce + residual add + RMSNorm of a call planned by
// PlanFusedCall (cuda_fused.cu); the same enqueue-only contract.
cudaError_t LaunchRankFused(const RankCall& call, const FusedCall& fused, cudaStream_t stream);

namespace cuda {
struct KernelArgs;
}
// The kernel arguments of a planned call: every rank's workspace and explicit
// slots, the chain's lane, the layout.
cuda::KernelArgs MakeKernelArgs(const RankCall& call);

// Loads every kernel on the current device now: a lazy module load while a
// peer spins can deadlock on the driver's process-wide lock.
void PreloadCudaKernelsOnCurrentDevice();
void PreloadFusedKernels();  // cuda_fused.cu; called by the above

}  // namespace sifar
