"""Every import bench.decode makes from models/ beyond the package's top-level names
(models.Decoder, models.DecodeOptions, models.make_mesh, models.LOOPS, models.to_rows,
models.random_params, models.family_of), in one place."""

from models.core.sharding import KV_LAYOUTS  # noqa: F401
from models.core.tp import ALLREDUCE_KINDS, fused_add_norm_available  # noqa: F401
from models.decoder import compile_cache, hlo  # noqa: F401
from models.decoder.capacity import prompt_bucket  # noqa: F401
from models.decoder.options import ATTN_IMPLS, SIFAR_KINDS  # noqa: F401
from models.qwen3_moe.config import MOE_IMPLS  # noqa: F401
from models.registry import presets  # noqa: F401
from models.weights.types import is_projection  # noqa: F401


def step_forward(family, layout, options, ranks: int, allreduce: str):
    """The family's fast step's one-token forward (Llama's persistent step) at `ranks` virtual
    ranks with `allreduce` ("sifar" or "oneshot") inside its one launch (ranks 1:
    sifar_jax.llama_step)."""
    if family.fast_step is None:
        raise ValueError(f"the {family.name} family has no one-kernel step")
    return family.fast_step.make_forward(family, layout, options, virtual_ranks=ranks,
                                         allreduce=allreduce)
