"""models/sharding.py on Fp8Weight params: q's spec is the einsum weight's permuted, the scale's
out dims split with q's where the block grid lines up with the shards, else left whole and the
rank's blocks taken by offset inside shard_map (sharding.local_fp8). Each case: the sharded
product under shard_map against the unsharded one at TP 2 and 4 (column-parallel: bit-identical;
row-parallel: the partial sums added by psum, within 2 bf16 roundings)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from models.core import sharding
from models.core.tp import project
from models.weights.types import E4M3, Fp8Weight, Projection, matvec_fp8, quantize_fp8


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def blocked(q_shape, n_in, block, seed):
    """An Fp8Weight of random e4m3 values [*out, *in] with random scales over `block`s."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(np.clip(rng.standard_normal(q_shape) * 64, -448, 448), E4M3)
    n_out = len(q_shape) - n_in
    k = int(np.prod(q_shape[n_out:]))
    grid = q_shape[:n_out - 1] + (-(-q_shape[n_out - 1] // block[0]), -(-k // block[1]))
    return Fp8Weight(q, jnp.asarray(rng.uniform(0.5, 2, grid).astype(np.float32) / 1024), n_in,
                     block)


# (name, equation, x shape, weight, projection, einsum dim split, row-parallel, scale split at tp=2)
CASES = [
    ("gate_up_channel", "bth,hcf->btcf", (1, 1, 64), lambda: quantize_fp8(jnp.asarray(
        rand((64, 2, 320), 0)), 1), Projection(1), 2, False, True),
    ("gate_up_blocks_misaligned", "bth,hcf->btcf", (1, 1, 256),
     lambda: blocked((2, 320, 256), 1, (128, 128), 1), Projection(1), 2, False, False),
    ("lm_head_blocks_aligned", "bth,hv->btv", (1, 1, 256),
     lambda: blocked((512, 256), 1, (128, 128), 2), Projection(1), 1, False, True),
    ("qkv_blocks", "bth,hkgd->btkgd", (1, 1, 128),
     lambda: blocked((4, 3, 16, 128), 1, (16, 128), 3), Projection(1), 1, False, True),
    ("down_channel", "btf,fh->bth", (1, 1, 320), lambda: quantize_fp8(jnp.asarray(
        rand((320, 64), 4)), 1), Projection(1), 0, True, False),
    ("down_blocks_misaligned", "btf,fh->bth", (1, 1, 320),
     lambda: blocked((64, 320), 1, (128, 128), 5), Projection(1), 0, True, False),
    ("o_blocks_aligned", "bthd,hdm->btm", (1, 1, 8, 64),
     lambda: blocked((64, 8, 64), 2, (64, 128), 6), Projection(2), 0, True, True),
]


def _run(mesh, eq, x, w, spec, x_spec, row, out_dim):
    def body(x, w):
        y = project(eq, x, sharding.local_fp8(w, spec), preferred_element_type=jnp.float32)
        return jax.lax.psum(y, "tp") if row else y

    n = len(eq.split("->")[1])
    out = P() if row else P(*["tp" if i == out_dim else None for i in range(n)])
    placed = jax.device_put(w, jax.tree.map(lambda s: NamedSharding(mesh, s), spec))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, spec), out_specs=out,
                                 check_vma=False))(x, placed)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sharded_fp8_projection_equals_unsharded(cpu_mesh, case, tp):
    name, eq, xs, make, proj, dim, row, scale_split = case
    mesh = cpu_mesh(tp, init=False)
    w = make()
    x = jnp.asarray(rand(xs, 7), jnp.bfloat16)
    spec = sharding.fp8_spec(w, dim, proj, "tp", tp)
    qdim = proj.q_dim(w.q.ndim, dim)
    assert spec.q[qdim] == "tp" and sum(a == "tp" for a in spec.q) == 1
    if tp == 2:
        assert ("tp" in tuple(spec.scale)) == scale_split, spec
    want = np.asarray(project(eq, x, w, preferred_element_type=jnp.float32))
    # row-parallel: the contracted dim (x's last dims) split; column-parallel: x whole
    x_spec = P(*([None] * 2 + ["tp"] + [None] * (len(xs) - 3))) if row else P()
    got = np.asarray(_run(mesh, eq, x, w, spec, x_spec, row, len(xs) - w.n_in + qdim))
    # float32 sums of the same products (XLA:CPU's dot may order a shard's sums otherwise)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert np.abs(got - want).max() < 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_stack_misaligned_blocks(cpu_mesh, tp):
    """Expert stacks (a leading expert dim): gate_up [E, h, 2, I=320] with 128-row blocks split
    over I, down [E, I, h] split over its contracted I; each rank's rows start inside a block."""
    mesh = cpu_mesh(tp, init=False)
    e, h, i = 4, 128, 320
    gate_up = blocked((e, 2, i, h), 1, (128, 128), 8)
    down = blocked((e, h, i), 1, (128, 128), 9)
    proj = Projection(1, lead=1)
    gspec = sharding.fp8_spec(gate_up, 3, proj, "tp", tp)
    dspec = sharding.fp8_spec(down, 1, proj, "tp", tp)
    assert gspec.q == P(None, None, "tp", None) and gspec.scale == P(None, None, None, None)
    assert dspec.q == P(None, None, "tp") and dspec.scale == P(None, None, None)
    x = jnp.asarray(rand((3, h), 10), jnp.float32)
    ids = jnp.asarray([0, 3, 2], jnp.int32)

    def body(x, g, d):
        g, d = sharding.local_fp8(g, gspec), sharding.local_fp8(d, dspec)
        hmid = matvec_fp8(x, g, ids)
        return jax.lax.psum(matvec_fp8(hmid[:, 0] * hmid[:, 1], d, ids), "tp")

    def place(w, spec):
        return jax.device_put(w, jax.tree.map(lambda s: NamedSharding(mesh, s), spec))

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), gspec, dspec), out_specs=P(),
                                check_vma=False))(x, place(gate_up, gspec), place(down, dspec))
    hmid = matvec_fp8(x, gate_up, ids)
    want = np.asarray(matvec_fp8(hmid[:, 0] * hmid[:, 1], down, ids))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_param_specs_need_the_projection_table():
    w = quantize_fp8(jnp.asarray(rand((64, 32), 11)), 1)
    with pytest.raises(ValueError, match="not a projection"):
        sharding.param_specs({"router": w}, {}, "tp", {}, 2)
    specs = sharding.param_specs({"down": w, "norm": jnp.ones(4)}, {"down": 0}, "tp",
                                 {"down": Projection(1)}, 2)
    assert specs["down"].q == P(None, "tp") and "tp" not in tuple(specs["down"].scale)
    assert specs["norm"] == P()
