"""Time to first token: bench.decode --ttft (bench/ttft.py) and the decoder's account of which
all-reduce a prefill runs (tiny preset, 8 host CPU devices from conftest.py)."""

import json

import numpy as np
import pytest

import sifar_jax
from bench import ttft
from models import Decoder, LlamaConfig, make_mesh, random_params


@pytest.fixture
def sifar_clean():
    sifar_jax.shutdown()
    yield
    sifar_jax.shutdown()


def test_the_floor_is_the_larger_of_compute_and_weights():
    # Llama-3.1-8B, 1K-token prompt, TP=2 on H200s: 16 TFLOP over 2 GPUs at 989 TFLOP/s
    f = ttft.floor(8_030_261_248, 8_030_261_248, 1024, 2, 989e12, 4.3e12)
    assert f["compute_floor_ms"] == pytest.approx(2 * 8.03e9 * 1024 / 2 / 989e12 * 1e3, rel=1e-3)
    assert f["weights_floor_ms"] == pytest.approx(8.03e9 / 4.3e12 * 1e3, rel=1e-3)
    assert f["floor_bound"] == "compute" and f["floor_ms"] == f["compute_floor_ms"]
    short = ttft.floor(8_030_261_248, 8_030_261_248, 16, 2, 989e12, 4.3e12)
    assert short["floor_bound"] == "weights" and short["floor_ms"] == short["weights_floor_ms"]
    assert ttft.floor(10, 10, 16, 1, None, 4.3e12)["floor_ms"] is None  # a CPU: no bf16 rate
    assert ttft.parse_lengths("128,1024 4096", "gpu") == [128, 1024, 4096]
    assert ttft.parse_lengths("default", "cpu") == list(ttft.DEFAULT_LENGTHS["cpu"])


def test_prefill_allreduce_says_when_sifar_falls_back(sifar_clean):
    """tiny, float32, hidden 128: a 128-slot prompt bucket is a 64 KiB payload (sifar's default
    slot), a 256-slot one is not; the decoder's account agrees with what ran (sifar's call
    counters: algorithm "auto" hands a payload past the slot to lax.psum without a warning)."""
    import sifar_jax

    config = LlamaConfig.tiny(max_seq_len=512)
    mesh = make_mesh(2)
    dec = Decoder(config, mesh, random_params(config, mesh, seed=2), allreduce="sifar")

    def sifar_calls() -> int:
        return sum(s["calls"] for s in sifar_jax.stats().values())

    for n, fits in ((100, True), (129, False)):
        dec.reset()
        before = sifar_calls()
        np.asarray(dec.prefill(np.arange(n)[None] % config.vocab_size))
        assert (sifar_calls() > before) == fits, n
        said = dec.prefill_allreduce(n)
        assert said == "sifar" if fits else said.startswith("psum (fallback: payload of 131072")
    psum = Decoder(config, mesh, random_params(config, mesh, seed=2))
    assert psum.prefill_allreduce(129) == "psum"


def test_bench_decode_ttft_writes_records_per_variant_and_length(tmp_path, sifar_clean, capsys,
                                                                timing_figures):
    from bench import decode, report

    assert decode.main(["--quick", "--tp", "2", "--allreduce", "psum,sifar", "--fused", "off",
                        "--ttft", "16,129", "--ttft-only", "--samples", "1",
                        "--out", str(tmp_path)]) == 0
    records = json.loads(next(tmp_path.glob("ttft-*.json")).read_text())
    got = {(r["allreduce"], r["prompt_len"]): r for r in records}
    assert set(got) >= {(a, n) for a in ("psum", "sifar") for n in (16, 129)}
    # the in-decoder baselines name their algorithm: a prefill past the slot is theirs to refuse
    skipped = {(r["allreduce"], r["prompt_len"]) for r in records if "skipped" in r}
    assert skipped == {("sifar:oneshot", 129), ("sifar:twoshot", 129)}
    for r in (r for r in records if "skipped" not in r):
        assert r["tp"] == 2 and r["ttft_ms_median"] > 0 and len(r["ttft_ms"]) == 1
        assert r["prompt_bucket"] == (16 if r["prompt_len"] == 16 else 256)
        assert r["floor_ms"] is None and r["weights_floor_ms"] > 0  # no bf16 rate for a CPU
    assert got[("sifar", 16)]["prefill_allreduce"] == "sifar"
    assert got[("sifar", 129)]["prefill_allreduce"].startswith("psum (fallback")
    md = next(tmp_path.glob("ttft-*.md")).read_text()
    assert "Time to first token" in md and "psum (fallback" in md
    assert all(r[report.CPU_FLAG] for r in records)  # a CPU run: raw numbers, flagged
    assert timing_figures(md) == [] and timing_figures(capsys.readouterr().out) == []
    assert not list(tmp_path.glob("decode-*.json"))  # --ttft-only: no decode loops
