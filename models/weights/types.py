"""FP8 weights: the one quantized weight type every projection takes (core/tp.py, project).

`Fp8Weight` holds a projection's e4m3 values `q` in the kernel's layout (output dims first, then
the contracted dims: [*out, *in], each dim a tensor-parallel shard can split where the einsum
weight [*in, *out] is split) and its float32 `scale` over a grid of (block_n x block_k) blocks of
the 2D view [N = prod(out), K = prod(in)]: per tensor, per output channel (block_n = 1) or
checkpoint blocks (block_n divides out[-1], so a block never straddles the other out dims).
w = q x scale. It is a pytree whose leaves are the float8_e4m3fn `q` and the `scale`; the
block and the dims' split are static.

On CUDA GPUs `project` runs sifar_jax.fp8_matvec (the weight read once, in FP8); elsewhere
XLA's dequantize-and-dot (the same product, float32 sums).

`RowWeight` is a dense projection in the same output-major layout, without scales: the [N, K]
rows the persistent step (sifar_jax.llama_step) streams, held once for both steps. `project`
reads it as an einsum over its dims in their stored order: XLA's dot takes the contracted dims
last. An MoE's expert stack keeps its expert dim first, as an Fp8Weight stack's q ([E, *out,
*in]: out dims (E, ...)), the layout sifar_jax.qwen3_moe_step streams. (XLA:CPU transposes
some of them back inside its fused dots on every step; tests/models/test_row_weights.py checks
that XLA:GPU writes no copy of them.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .fp8_checkpoint import channel_scale

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class Fp8Weight:
    q: jax.Array  # [*out, *in] float8_e4m3fn
    scale: jax.Array  # float32 [*out[:-1], ceil(out[-1] / block_n), ceil(K / block_k)]
    n_in: int  # how many trailing dims of q are contracted
    block: tuple[int, int]  # (block_n, block_k) of out[-1] and of the 2D view's K

    def tree_flatten(self):
        return (self.q, self.scale), (self.n_in, self.block)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __getitem__(self, idx):  # nnx.Param(...)[...] returns the weight itself
        if idx is not Ellipsis:
            raise TypeError("Fp8Weight supports only [...]")
        return self

    @property
    def out_dims(self) -> tuple[int, ...]:
        return tuple(self.q.shape[: self.q.ndim - self.n_in])

    @property
    def in_dims(self) -> tuple[int, ...]:
        return tuple(self.q.shape[self.q.ndim - self.n_in:])

    def kernel_operands(self):
        """(q2 [N, K], scale2 [SN, SK], block) for sifar_jax.fp8_matvec (local shapes)."""
        from sifar_jax import fp8_matvec as f8

        n, k = math.prod(self.out_dims), math.prod(self.in_dims)
        last = self.out_dims[-1]
        bn, bk = min(self.block[0], last), min(self.block[1], k)
        scale = self.scale
        if last % bn:  # a block straddling out[-1]'s end: the same scales on a finer grid
            fine = math.gcd(bn, last)
            scale = f8.regrid_scale(scale, (bn, bk), last, k, (fine, bk))
            bn = fine
        grid = (math.ceil(n / bn), math.ceil(k / bk))
        return self.q.reshape(n, k), scale.reshape(grid), (bn, bk)


@dataclass(frozen=True)
class Projection:
    """What a family's table (its `projections`) says of one projection weight: n_in, how many
    of its einsum weight's leading dims (after `lead` stacked ones: an MoE's experts) are
    contracted. The einsum weight is [*lead, *in, *out]; its Fp8Weight's q is [*lead, *out, *in]."""
    n_in: int
    lead: int = 0

    def q_perm(self, ndim: int) -> tuple[int, ...]:
        """q = transpose(einsum weight, q_perm): q's dim j is the einsum weight's q_perm[j]."""
        lead, k = self.lead, self.n_in
        return tuple(range(lead)) + tuple(range(lead + k, ndim)) + tuple(range(lead, lead + k))

    def q_dim(self, ndim: int, dim: int) -> int:
        """The dim of q that is the einsum weight's `dim`."""
        return self.q_perm(ndim).index(dim)

    def einsum_shape(self, w) -> tuple[int, ...]:
        """The einsum weight's shape of an Fp8Weight or a RowWeight."""
        q = w.q if isinstance(w, Fp8Weight) else w.w
        perm, shape = self.q_perm(q.ndim), [0] * q.ndim
        for j, d in enumerate(perm):
            shape[d] = q.shape[j]
        return tuple(shape)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class RowWeight:
    """A dense projection stored output-major: w [*out, *in] in the model's dtype (transforms.py,
    to_rows), the layout of an Fp8Weight's q (a stack's out dims start with its experts)."""
    w: jax.Array  # [*out, *in]
    n_in: int  # how many trailing dims of w are contracted

    def tree_flatten(self):
        return (self.w,), (self.n_in,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __getitem__(self, idx):  # nnx.Param(...)[...] returns the weight itself
        if idx is not Ellipsis:
            raise TypeError("RowWeight supports only [...]")
        return self

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def out_dims(self) -> tuple[int, ...]:
        return tuple(self.w.shape[: self.w.ndim - self.n_in])

    @property
    def in_dims(self) -> tuple[int, ...]:
        return tuple(self.w.shape[self.w.ndim - self.n_in:])

    def rows(self) -> jax.Array:
        """The weight as [N, K] rows (local shapes)."""
        return self.w.reshape(math.prod(self.out_dims), math.prod(self.in_dims))


def to_row_weight(w, n_in: int, lead: int = 0) -> RowWeight:
    """An einsum-layout weight [*lead, *in, *out] (n_in contracted dims after `lead` stacked
    ones: an MoE's experts) -> RowWeight [*lead, *out, *in], an Fp8Weight stack's q layout (its
    out dims then start with the stacked ones, as that q's do)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    return RowWeight(xp.transpose(w, Projection(n_in, lead).q_perm(w.ndim)), n_in)


def from_row_weight(w: RowWeight, lead: int = 0) -> jax.Array:
    """The einsum-layout weight [*lead, *in, *out] of a RowWeight (lead: its stacked dims)."""
    perm = Projection(w.n_in, lead).q_perm(w.w.ndim)
    return jnp.transpose(w.w, tuple(np.argsort(perm)))


def stored_equation(equation: str, w: RowWeight) -> str:
    """An einsum equation written for the einsum-layout weight ('...<in>,<in><out>->...<out>'),
    rewritten for w as it is stored: the weight's subscripts reordered to out then in."""
    xs, ws, out = _parse(equation, w, "a RowWeight")
    return f"{xs},{ws[w.n_in:]}{ws[:w.n_in]}->{out}"


def is_projection(x) -> bool:
    """Whether a pytree node is a projection in the kernels' layout (Fp8Weight or RowWeight):
    the `is_leaf` of trees that hold them."""
    return isinstance(x, (Fp8Weight, RowWeight))


def is_fp8(x) -> bool:
    """Whether a pytree node is an Fp8Weight (the `is_leaf` of trees that hold them)."""
    return isinstance(x, Fp8Weight)


def is_quantized(params) -> bool:
    """Whether any leaf of a parameter tree is an Fp8Weight."""
    return any(is_fp8(x) for x in jax.tree.leaves(params, is_leaf=is_fp8))


def quantize_fp8(w: jax.Array | np.ndarray, n_in: int) -> Fp8Weight:
    """Per output channel: w in the einsum layout [*in, *out] (n_in leading contracted dims)
    -> Fp8Weight, scale = max |w| over the channel x float32(1/448) (fp8_checkpoint's
    channel_scale; 1 where the channel is all zeros).
    No reshape across dims: under jit a sharded w stays sharded (a contracted dim split over
    devices takes one max over them, never a gather)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    perm = tuple(range(n_in, w.ndim)) + tuple(range(n_in))
    wt = xp.transpose(xp.asarray(w, np.float32), perm)  # [*out, *in]
    n_out = w.ndim - n_in
    amax = xp.max(xp.abs(wt), axis=tuple(range(n_out, w.ndim)), keepdims=True)
    scale = channel_scale(amax, xp)  # the same bits as the loader's quantize="fp8"
    q = xp.clip(wt / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return Fp8Weight(q, scale.reshape(wt.shape[:n_out] + (1,)), n_in,
                     (1, math.prod(wt.shape[n_out:])))


def dequantize(w: Fp8Weight, dtype=jnp.bfloat16) -> jax.Array:
    """The weight in the einsum layout [*in, *out] as dtype (q x scale in float32, rounded once)."""
    from sifar_jax import fp8_matvec as f8

    q2, s2, block = w.kernel_operands()
    full = f8.dequantize(q2, s2, block, jnp.float32).reshape(w.q.shape)
    n_out = w.q.ndim - w.n_in
    perm = tuple(range(n_out, w.q.ndim)) + tuple(range(n_out))
    return jnp.transpose(full, perm).astype(dtype)


def _parse(equation: str, w, what: str = "an Fp8Weight") -> tuple[str, str, str]:
    lhs, out = equation.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
    contracted = ws[: w.n_in]
    if (ws[w.n_in:] != out[len(out) - (len(ws) - w.n_in):] or not xs.endswith(contracted)
            or any(c in out for c in contracted)):
        raise ValueError(f"project: {what} needs '...<in>,<in><out>->...<out>' "
                         f"(the weight's {w.n_in} contracted dims first), got {equation!r}")
    return xs, ws, out


def _check_k(k: int, what: str) -> None:
    """The FP8 GEMV reads rows in 16-byte chunks: say which weight and what to change."""
    from sifar_jax import fp8_matvec as f8

    if k % f8.CHUNK:
        raise ValueError(f"{what}: {k} contracted columns on this rank, not a multiple of "
                         f"{f8.CHUNK} (the FP8 GEMV's unit): use a tensor-parallel size that "
                         f"leaves each rank a multiple of {f8.CHUNK}, or keep the model dense")


def project_fp8(equation: str, x: jax.Array, w: Fp8Weight, **kw) -> jax.Array:
    """jnp.einsum(equation, x, dequantize(w)) for an Fp8Weight, as one batch-1..8 GEMV: x's
    leading (batch) dims flattened into rows. The sums are float32 either way; with
    preferred_element_type=float32 (the LM head's logits) x goes in as float32, so the result
    is the float32 sum, not its rounding to x's dtype."""
    from sifar_jax import fp8_matvec as f8

    xs, ws, out = _parse(equation, w)
    lead = x.shape[: len(xs) - w.n_in]
    k = math.prod(x.shape[len(lead):])
    if tuple(x.shape[len(lead):]) != w.in_dims:
        raise ValueError(f"project: x's contracted dims {x.shape[len(lead):]} are not the "
                         f"weight's {w.in_dims}")
    dt = kw.get("preferred_element_type")
    if dt is not None and jnp.dtype(dt) in f8.X_DTYPES:
        x = x.astype(dt)
    _check_k(k, f"an FP8 projection {equation!r} of in dims {w.in_dims}")
    q2, s2, block = w.kernel_operands()
    y = f8.fp8_matvec(x.reshape(-1, k), q2, s2, block=block)
    y = y.reshape(lead + w.out_dims)
    return y if dt is None else y.astype(dt)


def matvec_fp8(x: jax.Array, w: Fp8Weight, ids: jax.Array,
               name: str = "an FP8 expert stack") -> jax.Array:
    """y[m] = x[m] @ dequantize(w)[ids[m]] for an expert stack (out dims (E, *rest)): x [M, *in]
    -> [M, *rest], each row against its chosen expert's weight, read in place in FP8. name:
    the stack's, for errors."""
    from sifar_jax import fp8_matvec as f8

    e, rest = w.out_dims[0], w.out_dims[1:]
    if not rest:
        raise ValueError("matvec_fp8: the stack's out dims must be (E, ...) with >= 1 more dim")
    one = Fp8Weight(w.q[0], w.scale[0], w.n_in, w.block)  # the per-expert view's operands
    q2, s2, block = one.kernel_operands()
    n, k = q2.shape
    _check_k(k, f"{name} of in dims {w.in_dims}")
    scale = w.scale
    if s2.size != math.prod(w.scale.shape[1:]):  # regridded: the stack's scales likewise
        scale = jax.vmap(lambda s: Fp8Weight(w.q[0], s, w.n_in, w.block).kernel_operands()[1])(
            w.scale)
    y = f8.fp8_matvec(x.reshape(x.shape[0], k), w.q.reshape(e, n, k),
                      scale.reshape((e,) + s2.shape), ids, block=block)
    return y.reshape((x.shape[0],) + rest)


def quantize_fp8_stack(w: jax.Array, n_in: int) -> Fp8Weight:
    """An expert stack [E, *in, *out] per output channel -> Fp8Weight with out dims (E, *out)."""
    one = jax.vmap(lambda we: quantize_fp8(we, n_in))(jnp.asarray(w))
    return Fp8Weight(one.q, one.scale, n_in, one.block)


def dequantize_stack(w: Fp8Weight, dtype=jnp.bfloat16) -> jax.Array:
    """An expert stack's weights [E, *in, *out] as dtype."""
    return jax.vmap(lambda q, s: dequantize(Fp8Weight(q, s, w.n_in, w.block), dtype))(w.q, w.scale)
