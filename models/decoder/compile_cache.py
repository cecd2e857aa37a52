"""JAX's persistent compilation cache, on by default for the CLI and the benchmarks: a second start
reads the executables the first one compiled instead of compiling them again (at Llama-8B shapes
each decode step or prefill executable is seconds of XLA:GPU compile).

The directory: $SIFAR_JAX_COMPILE_CACHE if set, else $XDG_CACHE_HOME/sifar-jax/jax-cache, else
~/.cache/sifar-jax/jax-cache. SIFAR_JAX_NO_COMPILE_CACHE=1 (or the tools' --no-compile-cache)
turns it off. Every executable is written, however fast it compiled (min compile time 0, no
minimum size). As JAX says of its cache: trust the directory as you trust your code (whoever can
write to it can make this process run code). Library code never turns it on by itself; the test
suite only with a temporary directory.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

ENV_DIR = "SIFAR_JAX_COMPILE_CACHE"
ENV_OFF = "SIFAR_JAX_NO_COMPILE_CACHE"
HIT_EVENT = "/jax/compilation_cache/cache_hits"
MISS_EVENT = "/jax/compilation_cache/cache_misses"


def default_dir() -> str:
    """The directory the tools use (see the module docstring)."""
    if os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sifar-jax", "jax-cache")


def off_by_env() -> bool:
    return os.environ.get(ENV_OFF, "").strip().lower() not in ("", "0", "false", "no")


def enable(path: Optional[str] = None, *, off: bool = False) -> Optional[str]:
    """Turn the persistent cache on at `path` (default_dir() if None) unless `off` or
    SIFAR_JAX_NO_COMPILE_CACHE is set; the directory used, or None. Call it before the first
    compile of the process (JAX opens its cache once; reset_cache lets a test reopen it)."""
    if off or off_by_env():
        return None
    import jax

    path = path or default_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no minimum size
    return path


def disable() -> None:
    """Turn it off again (tests), closing the cache JAX opened."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()


@dataclasses.dataclass
class CacheUse:
    """Hits and misses of the persistent cache while it is entered (JAX's monitoring events)."""

    hits: int = 0
    misses: int = 0

    def _seen(self, event: str, **kw) -> None:
        if event == HIT_EVENT:
            self.hits += 1
        elif event == MISS_EVENT:
            self.misses += 1

    def __enter__(self) -> "CacheUse":
        import jax

        jax.monitoring.register_event_listener(self._seen)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        jax.monitoring.unregister_event_listener(self._seen)

    def describe(self) -> str:
        if not self.hits and not self.misses:
            return "no compilation cache"
        start = "warm" if self.hits and not self.misses else ("cold" if not self.hits else "partly warm")
        return f"{start} start: {self.hits} read from the compilation cache, {self.misses} compiled"
