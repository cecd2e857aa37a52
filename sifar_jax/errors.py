"""Exceptions raised by sifar_jax."""


class SifarError(RuntimeError):
    """An all-reduce failed at run time (timeout, failed communicator)."""


class NotInitializedError(RuntimeError):
    """sifar_psum was traced for an axis that sifar_jax.init(mesh) did not set up."""
