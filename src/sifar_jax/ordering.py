"""The order of all-reduces: every rank must pair the same calls.

Side effects do not order custom calls: XLA:CPU runs independent ones
concurrently, XLA:GPU command buffers make them concurrent graph nodes. Two
mechanisms make the order a property of the communicator (docs/design.md,
"Ordering"):

* Within one jaxpr, every call takes the previous call's result as an extra
  operand that the handler never reads (`operands`/`remember`): a buffer
  dependence every scheduler honours, so calls run in trace order.
* Across jaxprs (a scan body and its caller, separate executables, threads),
  which no data dependence links, each jaxpr is a *chain* with its own id
  (`chain_id`), counted per communicator (its axis key): ranks in several
  processes agree on it as long as they trace the jaxprs that call sifar on
  that axis in the same order, whatever else each traces. The communicator
  keeps one lane (epochs and slots) per chain slot, and every epoch tag
  carries the chain, so two chains never pair each other's words: independent
  chains run concurrently without mixing, and a mismatch that cannot be
  resolved times out with a clear error instead of returning a wrong sum.

Executables are ordered by the host: every device runs them in the order they
were dispatched. Two threads that dispatch at the same time can enqueue two
executables in different orders on different devices; each then waits for a
peer stuck in the other one (NCCL deadlocks the same way). Threads that
dispatch computations using sifar all-reduces on the same devices therefore
hold `dispatch_lock` around each call; without it the worst case is a timeout
with a clear error, never a wrong sum.
"""

from __future__ import annotations

import itertools
import threading
import weakref

from . import _jax_compat

_lock = threading.Lock()

# Held around the dispatch of a jitted call, so that its per-device launches
# are enqueued on every device before another thread's (see above).
dispatch_lock = threading.RLock()
# communicator scope (axis key) -> the next chain id there
_next_chain: "dict[int, itertools.count]" = {}
# trace -> [{scope: chain id}, weak ref to the last result]. Both sides weak (a
# tracer refers to its trace), so a finished trace is forgotten and no limit on
# the number of remembered traces is needed; the trace keeps its tracers alive.
_chains: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _entry(trace):
    e = _chains.get(trace)
    if e is None:
        e = _chains[trace] = [{}, None]
    return e


def chain_id(x, scope: int = 0) -> int:
    """The chain of the jaxpr `x` is being traced into, numbered among the
    jaxprs that called chain_id with this `scope` (a communicator's axis key);
    0 outside any trace."""
    trace = _jax_compat.trace_of(x)
    if trace is None:
        return 0
    with _lock:
        ids = _entry(trace)[0]
        if scope not in ids:
            ids[scope] = next(_next_chain.setdefault(scope, itertools.count(1)))
        return ids[scope]


def operands(x) -> list:
    """Ordering operands for the next all-reduce traced into x's jaxpr."""
    trace = _jax_compat.trace_of(x)
    if trace is None:
        return []
    with _lock:
        ref = _entry(trace)[1]
    last = None if ref is None else ref()
    return [] if last is None else [last]


def remember(x, out) -> None:
    """Records `out` as the latest all-reduce result of x's jaxpr."""
    trace = _jax_compat.trace_of(x)
    if trace is not None:
        with _lock:
            _entry(trace)[1] = weakref.ref(out)
