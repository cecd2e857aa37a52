// The one table of FFI targets: every op the extension exports, with its
// handler per platform and the function that loads its CUDA kernels.  The
// module registers the handlers from it (module.cc: handlers(), targets()),
// sifar_jax reads the target names from there (src/sifar_jax/_ext.py, TARGETS),
// and `init` loads every op's kernels through it (PreloadCudaKernels).
//
//   X(op, target name, CPU handler, CUDA handler, CUDA kernel preload)
//
// A new op adds one row here; its handlers and preload are defined in its own
// folder (allreduce/, fused/, matvec/, step/).  Loading is idempotent: ops that share kernels
// may name the same preload.
#pragma once

#include "xla/ffi/api/ffi.h"

#define SIFAR_FFI_TARGETS(X)                                                                  \
  /* x -> y, on the communicator's internal dual slots */                                     \
  X(allreduce, "sifar_allreduce", CpuAllReduce, CudaAllReduce, PreloadAllReduceKernels)       \
  /* (x, buf, prev) -> (y, buf): user buffers (buf aliased in place, prev kept alive) */      \
  X(allreduce_into, "sifar_allreduce_into", CpuAllReduceInto, CudaAllReduceInto,              \
    PreloadAllReduceKernels)                                                                  \
  /* (x, residual, weight[, prefetch]) -> (normed, new_residual): + residual add, RMSNorm */  \
  X(psum_add_rmsnorm, "sifar_psum_add_rmsnorm", CpuPsumAddRmsNorm, CudaPsumAddRmsNorm,        \
    PreloadFusedKernels)                                                                  \
  /* (x [M, K], w [E, K, N], ids [M]) -> (y [M, N], workspace): batch-1 x @ w[ids] */         \
  X(matvec, "sifar_matvec", CpuMatVec, CudaMatVec, PreloadMatVecKernels)                    \
  /* (x [M, K], w [E, N, K] e4m3, scale, ids [M]) -> y [M, N]: FP8 weights, batch 1..8 */    \
  X(fp8_matvec, "sifar_fp8_matvec", CpuFp8MatVec, CudaFp8MatVec, PreloadFp8MatVecKernels)    \
  /* (x, rope, pos, final_norm, 10 per layer, cache[, head, head scale]) -> (h, cache, */     \
  /* workspace, logits): a Llama decode step with e4m3 or bf16 weights, one persistent */     \
  /* kernel on CUDA (step/llama_step.h) */                                                    \
  X(llama_step, "sifar_llama_step", CpuLlamaStep, CudaLlamaStep, PreloadLlamaStepKernels)     \
  /* the same step, one rank per device of a communicator's axis: this rank's shard, the */    \
  /* all-reduce of o and down a phase reading the peers' memory (step/llama_step_tp.h) */      \
  X(llama_step_tp, "sifar_llama_step_tp", CpuLlamaStepTp, CudaLlamaStepTp,                    \
    PreloadLlamaStepKernels)                                                                  \
  /* (x, rope, pos, final_norm, 13 per layer, cache[, head, head scale]) -> (h, cache, */     \
  /* workspace, logits): a Qwen3-MoE decode step, the experts chosen inside (TP = 1), one */   \
  /* persistent kernel on CUDA (step/qwen3_moe_step.h) */                                     \
  X(qwen3_moe_step, "sifar_qwen3_moe_step", CpuQwen3MoeStep, CudaQwen3MoeStep,                \
    PreloadQwen3MoeStepKernels)

namespace sifar {

#define SIFAR_DECLARE_CPU(op, name, cpu, cuda, preload) XLA_FFI_DECLARE_HANDLER_SYMBOL(cpu);
SIFAR_FFI_TARGETS(SIFAR_DECLARE_CPU)
#undef SIFAR_DECLARE_CPU

#ifdef SIFAR_WITH_CUDA
#define SIFAR_DECLARE_CUDA(op, name, cpu, cuda, preload) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(cuda);                  \
  void preload();
SIFAR_FFI_TARGETS(SIFAR_DECLARE_CUDA)
#undef SIFAR_DECLARE_CUDA

// Loads every op's kernels on the current device now (each row's preload): a
// lazy module load while a peer spins can deadlock on the driver's
// process-wide lock.  Defined in module.cc; the CUDA backend calls it for
// each device of a new group (runtime/cuda_memory.cu).
void PreloadCudaKernels();
#endif

}  // namespace sifar
