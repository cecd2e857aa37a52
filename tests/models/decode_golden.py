"""Golden tokens and logits of every decoder variant on CPU (tiny random models), so a
refactor can show it changed nothing: `python -m tests.models.decode_golden --write PATH`
records them; tests/models/test_decode_golden.py compares the current code against the
recorded file (tests/models/data/decode_golden.npz, written by the code before the options
object: commit 71ea98f).

Runs with either API: Decoder(..., options=DecodeOptions(...)) where models.DecodeOptions
exists, else the keywords of the original Decoder.
"""

from __future__ import annotations

import os
import sys

PROMPT = [5, 17, 3, 250, 99, 7, 42, 128]
RAGGED = [[5, 17, 3, 250, 99], [7, 42, 128, 9, 11, 13, 200, 31, 2]]
NEW = 12
CHUNK = 4

# name -> (family preset, tp, decoder options, batch); every one is run with every loop.
VARIANTS = {
    "psum_tp1": ("tiny", 1, {}, 1),
    "psum_tp2": ("tiny", 2, {}, 1),
    "psum_tp4_bhsd": ("tiny", 4, {"kv_layout": "bhsd"}, 1),
    "psum_tp2_gemm2": ("tiny", 2, {"gemm_rows": 2}, 1),
    "psum_tp2_pallas": ("tiny", 2, {"kv_layout": "bhsd", "attn_impl": "pallas"}, 1),
    "psum_tp2_nopack": ("tiny", 2, {"pack_params": False}, 1),
    "psum_tp2_batch2": ("tiny", 2, {}, 2),
    "sifar_tp2": ("tiny", 2, {"allreduce": "sifar"}, 1),
    "sifar_tp4_bhsd": ("tiny", 4, {"allreduce": "sifar", "kv_layout": "bhsd"}, 1),
    "sifar_buffers_tp2": ("tiny", 2, {"allreduce": "sifar_buffers"}, 1),
    "fused_tp2": ("tiny", 2, {"allreduce": "sifar", "fused": True}, 1),
    "fused_tp2_prefetch": ("tiny", 2, {"allreduce": "sifar", "fused": True,
                                       "prefetch_bytes": 4096}, 1),
    "fused_tp2_batch2": ("tiny", 2, {"allreduce": "sifar", "fused": True}, 2),
    "moe_tp2": ("qwen3_moe_tiny", 2, {}, 1),
    "moe_tp4_sifar": ("qwen3_moe_tiny", 4, {"allreduce": "sifar"}, 1),
    "moe_tp2_gather": ("qwen3_moe_tiny", 2, {"moe_impl": "gather"}, 1),
}
LOOPS = ("sync", "stream", "pipelined", "on_device")


def make_decoder(preset: str, tp: int, opts: dict, batch: int):
    import sifar_jax
    from models import make_mesh, registry

    sifar_jax.shutdown()
    opts = dict(opts)
    config = registry.preset(preset)
    if "moe_impl" in opts:
        config = config.replace(moe_impl=opts.pop("moe_impl"))
    family = registry.family_of(config)
    mesh = make_mesh(tp)
    params = family.random_params(config, mesh, seed=11)
    from models import Decoder

    try:
        from models import DecodeOptions
    except ImportError:  # the original API: every option a keyword
        return Decoder(config, mesh, params, batch_size=batch, **opts)
    return Decoder(config, mesh, params, DecodeOptions(**opts), batch_size=batch)


def run_variant(name: str) -> dict:
    """Every array this variant produces: per loop the greedy tokens (and with the stream loop a
    sampled run), the teacher-forced step logits, the prefill logits."""
    import numpy as np

    preset, tp, opts, batch = VARIANTS[name]
    dec = make_decoder(preset, tp, opts, batch)
    prompt = np.array([PROMPT] * batch, np.int32) if batch == 1 else RAGGED
    out = {}
    for loop in LOOPS:
        out[f"{name}/tokens_{loop}"] = dec.generate(prompt, NEW, loop=loop, chunk=CHUNK)
    out[f"{name}/tokens_sampled"] = dec.generate(prompt, NEW, temperature=0.8, top_p=0.9,
                                                 seed=3)
    out[f"{name}/tokens_eos"] = dec.generate(prompt, NEW, eos_id=[int(out[f"{name}/tokens_sync"][0, 3])],
                                             loop="on_device", chunk=CHUNK, early_exit=True)
    square = np.array([PROMPT] * batch, np.int32)
    out[f"{name}/teacher_forced"] = dec.teacher_forced_logits(square)
    dec.reset()
    out[f"{name}/prefill"] = np.asarray(dec.prefill(square))
    out[f"{name}/step"] = np.asarray(dec.step(square[:, -1]))
    out[f"{name}/prefill_allreduce"] = np.array(dec.prefill_allreduce(len(PROMPT)))
    return out


def run_all() -> dict:
    out = {}
    for name in VARIANTS:
        out.update(run_variant(name))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python -m tests.models.decode_golden --write PATH")
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}=8".strip()
    os.environ.setdefault("SIFAR_JAX_NO_COMPILE_CACHE", "1")
    import numpy as np

    np.savez_compressed(sys.argv[2], **run_all())
