"""Exceptions raised by sifar_jax."""


class SifarError(RuntimeError):
    """An all-reduce failed at run time (timeout, failed communicator)."""


class NotInitializedError(RuntimeError):
    """sifar_psum was traced for an axis that sifar_jax.init(mesh) did not set up."""


class UnboundAxisError(NameError, ValueError):
    """sifar_psum names an axis that no enclosing shard_map or vmap binds.

    A NameError, as lax.psum raises for an unbound axis; also a ValueError,
    which sifar_jax raised before it matched lax.psum.
    """
