"""bench.breakdown: a decode step's kernels by kind (matmul, attention, all-reduce, other) from
the step's optimised HLO: XLA:CPU's HLO of the real decoder, and GPU-shaped HLO text."""

from __future__ import annotations

import pytest

from bench import breakdown as sk


def _tiny_decoder(cpu_mesh, allreduce="psum"):
    from bench.decode import records, settings
    from models import DecodeOptions, random_params

    config = settings.PRESETS["tiny"]().replace(max_seq_len=256)
    mesh = cpu_mesh(2)
    params = random_params(config, mesh, seed=0)
    dec = records.make_decoder(config, mesh, params, DecodeOptions(allreduce=allreduce), 1, 256, 0)
    dec.seek(200, records.start_tokens(config, 1, 0))
    return dec


def test_breakdown_kinds_from_kernel_names():
    """bench.breakdown.kind_of: a kernel no HLO instruction names is classified by its name."""
    assert sk.kind_of("void sifar::cuda::FusedKernel<__nv_bfloat16, 2>(sifar::cuda::FusedArgs)") \
        == "sifar"
    assert sk.kind_of("gemm_fusion_dot_354") == "matmul"
    assert sk.kind_of("input_reduce_fusion_49") == "reduction"
    assert sk.kind_of("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert sk.kind_of("loop_multiply_fusion_126") == "other"
    assert sk.kind_of("mha_forward") == "attention"  # the Pallas decode kernel's name
    # sifar_jax.matvec's kernels (Qwen3's experts) are matmuls, not all-reduces
    assert sk.kind_of("void sifar::cuda::MatVecKernel<__nv_bfloat16, 8>(sifar::cuda::Args)") \
        == "matmul"
    assert sk.kind_of("void sifar::cuda::AddSplitsKernel<float>(sifar::cuda::Args, long)") \
        == "matmul"
    b = sk.breakdown([("mha_forward", 0, 4_000), ("gemm_fusion_dot_1", 5_000, 10_000),
                      ("loop_add_fusion", 16_000, 1_000)], steps=1, kinds={})
    assert (b["attention_us"], b["matmul_us"], b["other_us"], b["unmatched"]) == (4.0, 10.0, 1.0, 3)


def test_step_breakdown_classifies_the_decoder_step_hlo(cpu_mesh):
    """The kernels of a compiled decode step (XLA:CPU here) by kind: the weight matmuls (one per
    projection and the LM head), the KV-cache update and attention, the all-reduces, the rest;
    every kind's microseconds add up to the busy time, idle is span - busy."""
    dec = _tiny_decoder(cpu_mesh)
    kinds = sk.decoder_kinds(dec)
    text = dec.compiled_step().as_text()
    comps, entry, _ = sk._instructions(text)
    ops = {i[0]: i for instrs in comps.values() for i in instrs}
    layers = dec.config.num_layers
    # qkv, o, gate_up, down per layer and the LM head read a weight through a dot
    weight_dots = [n for n, k in kinds.items() if k == "matmul" and n in ops]
    assert len(weight_dots) >= 4 * layers + 1, weight_dots
    assert all(ops[n][2] in ("dot", "fusion", "custom-call") for n in weight_dots)
    # the cache update writes a cache-shaped value: attention
    updates = [n for n, i in ops.items() if "dynamic-update-slice" in n and n in kinds]
    assert updates and all(kinds[n] == "attention" for n in updates)
    assert sum(k == "all_reduce" for n, k in kinds.items() if n in ops) >= 2 * layers  # psum
    assert "other" in kinds.values()
    names = [n for n in kinds if n in ops][:6]
    kernels = [(n, 1000 * i * 10, 1000 * (i + 1), None) for i, n in enumerate(names)]
    b = sk.breakdown(kernels, 2, kinds)
    assert sum(b[f"{k}_us"] for k in sk.BREAKDOWN) == pytest.approx(b["busy_us"], abs=0.2)
    assert b["busy_us"] == pytest.approx(sum(i + 1 for i in range(6)) / 2, abs=0.1)
    assert b["idle_us"] == pytest.approx(b["span_us"] - b["busy_us"], abs=0.1)
    assert b["unmatched"] == 0



def test_step_breakdown_takes_the_arrays_the_step_is_passed_as_its_weights(cpu_mesh, monkeypatch):
    """With the norm scales packed, the step's weights are its first len(dec.weights.leaves) entry
    parameters, fewer than the params tree's leaves: counting those would class state arrays
    as weights."""
    import jax

    dec = _tiny_decoder(cpu_mesh)
    seen = []
    monkeypatch.setattr(sk, "hlo_kinds", lambda text, n, shapes: seen.append(n) or {})
    sk.decoder_kinds(dec)
    assert seen == [len(dec.weights.leaves)] and len(dec.weights.leaves) < len(jax.tree.leaves(dec.params))


GPU_LIKE_HLO = """HloModule jit_step, is_scheduled=true

FunctionNames
1 "Attention.__call__"
2 "rms_norm"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=1}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}

%gemm_computation (p0: bf16[1,64], p1: bf16[64,32]) -> bf16[1,32] {
  %p0 = bf16[1,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%softmax_computation (p0.1: f32[1,8]) -> f32[1,8] {
  %p0.1 = f32[1,8]{1,0} parameter(0)
  ROOT %exponential.1 = f32[1,8]{1,0} exponential(%p0.1), metadata={op_name="x" stack_frame_id=1}
}

%norm_computation (p0.2: bf16[1,64]) -> bf16[1,64] {
  %p0.2 = bf16[1,64]{1,0} parameter(0)
  ROOT %multiply.1 = bf16[1,64]{1,0} multiply(%p0.2, %p0.2), metadata={op_name="y" stack_frame_id=2}
}

%command_buffer (arg.0: bf16[1,64], arg.1: bf16[64,32], arg.2: f32[1,8]) -> (bf16[1,32], f32[1,8]) {
  %arg.0 = bf16[1,64]{1,0} parameter(0)
  %arg.1 = bf16[64,32]{1,0} parameter(1)
  %arg.2 = f32[1,8]{1,0} parameter(2)
  %bitcast.3 = bf16[64,32]{1,0} bitcast(%arg.1)
  %gemm_fusion_dot.7 = bf16[1,32]{1,0} fusion(%arg.0, %bitcast.3), kind=kCustom, calls=%gemm_computation
  %loop_exponential_fusion = f32[1,8]{1,0} fusion(%arg.2), kind=kLoop, calls=%softmax_computation
  ROOT %tuple.1 = (bf16[1,32]{1,0}, f32[1,8]{1,0}) tuple(%gemm_fusion_dot.7, %loop_exponential_fusion)
}

ENTRY %main.9 (param.0: bf16[64,32], param.1: bf16[1,64], param.2: bf16[1,4,16,8]) -> bf16[1,64] {
  %param.0 = bf16[64,32]{1,0} parameter(0), metadata={op_name="w"}
  %param.1 = bf16[1,64]{1,0} parameter(1)
  %param.2 = bf16[1,4,16,8]{3,2,1,0} parameter(2)
  %custom-call.2 = bf16[1,64]{1,0} custom-call(%param.1), custom_call_target="sifar_psum_add_rmsnorm"
  %loop_multiply_fusion.4 = bf16[1,64]{1,0} fusion(%custom-call.2), kind=kLoop, calls=%norm_computation
  %fusion.5 = f32[1,8]{1,0} fusion(%param.2), kind=kLoop, calls=%softmax_computation
  %call.6 = (bf16[1,32]{1,0}, f32[1,8]{1,0}) call(%loop_multiply_fusion.4, %param.0, %fusion.5), to_apply=%command_buffer
  %cublas-gemm.8 = bf16[1,32]{1,0} custom-call(%loop_multiply_fusion.4, %param.1), custom_call_target="__cublas$gemm"
  ROOT %add.9 = bf16[1,64]{1,0} add(%loop_multiply_fusion.4, %loop_multiply_fusion.4)
}
"""


MATVEC_HLO = """HloModule jit_step, is_scheduled=true

ENTRY %main.3 (param.0: bf16[8,64,32], param.1: bf16[1,64], param.2: s32[1]) -> bf16[1,32] {
  %param.0 = bf16[8,64,32]{2,1,0} parameter(0)
  %param.1 = bf16[1,64]{1,0} parameter(1)
  %param.2 = s32[1]{0} parameter(2)
  %custom-call.1 = (bf16[1,32]{1,0}, f32[256]{0}) custom-call(%param.1, %param.0, %param.2), custom_call_target="sifar_matvec"
  %get-tuple-element.2 = bf16[1,32]{1,0} get-tuple-element(%custom-call.1), index=0
  %custom-call.3 = bf16[1,32]{1,0} custom-call(%get-tuple-element.2), custom_call_target="sifar_allreduce"
  ROOT %copy.4 = bf16[1,32]{1,0} copy(%custom-call.3)
}
"""


def test_step_breakdown_counts_the_experts_matvec_as_a_matmul():
    """sifar_jax.matvec reading a weight (Qwen3's experts) is a matmul; only sifar_jax's
    all-reduce targets count as all_reduce (a Qwen3 TP=1 step once showed 1.3 ms of
    "all-reduce" with no all-reduce in it)."""
    kinds = sk.hlo_kinds(MATVEC_HLO, n_weights=1)
    assert kinds["custom-call.1"] == "matmul"
    assert kinds["custom-call.3"] == "all_reduce"


def test_step_breakdown_follows_weights_through_command_buffers():
    """GPU-shaped HLO: a Triton GEMM inside a command buffer reads entry parameter 0 (a weight)
    through the call and a bitcast: matmul; a cuBLAS GEMM reading a non-weight: not matmul;
    the fused all-reduce's custom call: all_reduce; a fusion from an attention function or
    reading the KV cache: attention; a norm: other. Kernels match by the profile's hlo_op stat
    or by the kernel name XLA:GPU derives from the instruction's."""
    kinds = sk.hlo_kinds(GPU_LIKE_HLO, n_weights=1, cache_shapes={"bf16[1,4,16,8]"})
    assert kinds["gemm_fusion_dot.7"] == "matmul" and kinds["gemm_fusion_dot_7"] == "matmul"
    assert kinds["custom-call.2"] == "all_reduce"
    assert kinds["loop_exponential_fusion"] == "attention"  # its source: Attention.__call__
    assert kinds["fusion.5"] == "attention"  # reads the cache (and the same source)
    assert kinds["loop_multiply_fusion.4"] == "other"
    assert kinds["cublas-gemm.8"] == "other"  # a GEMM, but of no weight
    assert "add.9" in kinds and "call.6" not in kinds and "param.0" not in kinds
    assert "dot.1" not in kinds  # inside a fusion: no kernel of its own
    kernels = [("gemm_fusion_dot_7", 0, 10_000), ("void sifar::cuda::FusedKernel<bf16>", 12_000, 5_000),
               ("sm90_xmma_gemm_bf16", 20_000, 4_000, "cublas-gemm.8"),
               ("some_library_kernel", 30_000, 1_000)]
    b = sk.breakdown(kernels, 1, kinds)
    assert (b["matmul_us"], b["all_reduce_us"], b["other_us"]) == (10.0, 5.0, 5.0)
    assert b["unmatched"] == 1 and b["idle_us"] == pytest.approx(31.0 - 20.0)
    assert b["overlap_us"] == 0.0
    # A command buffer runs independent kernels at once: overlap is counted apart, idle is the
    # time with no kernel running (on 1x H200 the old span - busy printed -87.5 us per step)
    both = [("gemm_fusion_dot_7", 0, 10_000), ("loop_multiply_fusion.4", 4_000, 10_000),
            ("add.9", 20_000, 2_000)]
    b = sk.breakdown(both, 1, kinds)
    assert b["busy_us"] == 22.0 and b["span_us"] == 22.0
    assert b["idle_us"] == pytest.approx(6.0) and b["overlap_us"] == pytest.approx(6.0)
