// Launching one rank's all-reduce kernel: the CUDA FFI handler's path after
// its checks, shared with the ops built on the all-reduce (fused/) and with
// the test harness that runs several ranks on one GPU (each on its own
// stream).
#pragma once

#include <cuda_runtime.h>

#include "allreduce/plan.h"

namespace sifar {

// Enqueues `call`'s kernel on `stream` (no host synchronisation; CUDA-graph
// safe).  `call` comes from PlanCall, or is filled by hand by a test harness
// (comm, group, rank, elem, algorithm, repeat, chain, lane_at, in, out,
// nbytes, and optionally explicit slots).  Multicast is not launched here.
cudaError_t LaunchRankAllReduce(const RankCall& call, cudaStream_t stream);

namespace cuda {
struct KernelArgs;
}
// The kernel arguments of a planned call: every rank's workspace and explicit
// slots, the chain's lane, the layout.
cuda::KernelArgs MakeKernelArgs(const RankCall& call);

// A CUDA handler's steps around its launch: its thread runs on the call's
// device; a launch's error as the handler's.
xla::ffi::Error UseDevice(int32_t ordinal);
xla::ffi::Error Launched(cudaError_t e);

}  // namespace sifar
