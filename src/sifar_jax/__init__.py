"""sifar-jax: synchronisation-free all-reduce for JAX on NVLink GPUs.

    import sifar_jax
    sifar_jax.init(mesh)
    y = jax.shard_map(lambda x: sifar_jax.sifar_psum(x, "tp"), mesh=mesh, ...)(x)
"""

from . import algorithms, benchmarking, distributed, fused, testing
from .algorithms import ALL as ALGORITHMS
from .architectures import build_info
from .choice import AllReduceChoice, allreduce_choice
from .buffers import DualBuffers, buffer_spec, make_buffers, sifar_psum_into
from .comm import DEFAULT_SLOT_BYTES, communicators, init, shutdown, unsupported, workspace_bytes
from .errors import NotInitializedError, SifarError, UnboundAxisError
from .fused import *  # noqa: F403 - the fused ops: fused.__all__ (psum_add_rmsnorm)
from .decode_step import LlamaLayer, StepStatus, check_step_status, llama_step_virtual_ranks
from .decode_step_tp import llama_step  # one device, or with axis_name= across a mesh axis
from .moe_step import Qwen3MoeLayer, qwen3_moe_step, qwen3_moe_step_virtual_ranks
from .info import info  # the function (python -m sifar_jax.info prints the same)
from .multicast import MulticastDisabledError
from .ordering import dispatch_lock
from .plan import SUPPORTED_DTYPES
from .psum import sifar_psum
from .replace import replace_psum
from .sharded import row_parallel, row_parallel_add_rmsnorm
from .stats import call_trace, check, stats

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "AllReduceChoice",
    "DEFAULT_SLOT_BYTES",
    "DualBuffers",
    "MulticastDisabledError",
    "Qwen3MoeLayer",
    "NotInitializedError",
    "SUPPORTED_DTYPES",
    "SifarError",
    "UnboundAxisError",
    "algorithms",
    "allreduce_choice",
    "benchmarking",
    "buffer_spec",
    "build_info",
    "call_trace",
    "check",
    "communicators",
    "distributed",
    "dispatch_lock",
    "info",
    "init",
    "make_buffers",
    "qwen3_moe_step",
    "qwen3_moe_step_virtual_ranks",
    "replace_psum",
    "row_parallel",
    "row_parallel_add_rmsnorm",
    "shutdown",
    "sifar_psum",
    "sifar_psum_into",
    "stats",
    "testing",
    "unsupported",
    "workspace_bytes",
    *fused.__all__,
]
