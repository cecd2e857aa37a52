// Launching one rank's all-reduce kernel: the CUDA FFI handler's path after
// its checks, shared with the test harness that runs several ranks on one GPU
// (each on its own stream).
#pragma once

#include <cuda_runtime.h>

#include "handlers.h"

namespace sifar {

// Enqueues `call`'s kernel on `stream` (no host synchronisation; CUDA-graph
// safe).  `call` comes from PlanCall, or is filled by hand by a test harness
// (comm, group, rank, elem, algorithm, repeat, chain, lane_at, in, out,
// nbytes, and optionally explicit slots).  Multicast is not launched here.
cudaError_t LaunchRankAllReduce(const RankCall& call, cudaStream_t stream);

// Loads every kernel on the current device now: a lazy module load while a
// peer spins can deadlock on the driver's process-wide lock.
void PreloadCudaKernelsOnCurrentDevice();

}  // namespace sifar
