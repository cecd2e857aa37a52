"""The library's defaults, in a module of their own: comm (which uses them to
set communicators up) and autotable (whose tables never choose sifar above the
default slot) both read them, and neither imports the other for them."""

from __future__ import annotations

import os

# The largest payload (per all-reduce, per device) a communicator serves
# without handing it to lax.psum (sifar_jax.init's slot_bytes).
DEFAULT_SLOT_BYTES = 64 * 1024
# Lanes per communicator: independent call chains (a scan body and its caller,
# executables run from several threads) that may be in flight at once without
# sharing epochs or slots (docs/design.md, "Ordering").
DEFAULT_LANES = 4
# Bound on every wait for a peer, in seconds.
DEFAULT_TIMEOUT_S = float(os.environ.get("SIFAR_TIMEOUT_S", "5.0"))
