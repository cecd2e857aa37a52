"""python -m sifar_jax.info: prints the report (sifar_jax/info/__init__.py)."""

from . import info

info()
