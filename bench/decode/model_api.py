"""Every import bench/ makes from models/ beyond the package's top-level names
(models.Decoder, models.DecodeOptions, models.make_mesh, models.LOOPS, models.to_rows,
models.random_params, models.family_of): bench.decode's, bench.ttft's and bench.breakdown's, in
one place to re-point as models/ moves into subpackages (docs of issue 58's layout)."""

from models import compile_cache, hlo  # noqa: F401
from models.attention import ATTN_IMPLS  # noqa: F401
from models.capacity import prompt_bucket  # noqa: F401
from models.families import presets  # noqa: F401
from models.options import SIFAR_KINDS  # noqa: F401
from models.quant import is_projection  # noqa: F401
from models.qwen3_moe import MOE_IMPLS  # noqa: F401
from models.sharding import KV_LAYOUTS  # noqa: F401
from models.tp import ALLREDUCE_KINDS, fused_add_norm_available  # noqa: F401


def step_forward(family, layout, options, ranks: int, allreduce: str):
    """The persistent step's one-token forward at `ranks` virtual ranks with `allreduce`
    ("sifar" or "oneshot") inside its one launch (ranks 1: sifar_jax.llama_step)."""
    from models import persistent

    return persistent.make_step_forward(family, layout, options, virtual_ranks=ranks,
                                        allreduce=allreduce)
