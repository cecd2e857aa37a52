"""Which step runs a decoder's one-token calls, decided here and nowhere else: the XLA step (the
model's forward) or the family's fast step (ModelFamily.fast_step; Llama's: the persistent step,
llama/step.py), as DecodeOptions.step asks.

The Decoder resolves it once, in its __init__ (choose_step), into a StepChoice: its executables
hand the choice's forward to the model's forward (make_forward's `step`), Decoder.step_kind and
Decoder.step_reason read it, and the CLI prints it. The rule (_rule): step "xla" (the default)
runs the XLA step; a fast step's name runs that step where the family has it and its reason()
is None, and otherwise the XLA step, the reason logged once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)
_LOGGED: set = set()  # the reasons logged so far (once each)


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """The step a decoder's one-token calls run. kind: "xla" or the fast step's name
    ("persistent"); reason: why the XLA step runs though options.step asked for another (None:
    it runs what was asked); make_forward: () -> the fast step's one-token forward (None: the
    XLA step's, the model's forward)."""

    kind: str = "xla"
    reason: Optional[str] = None
    make_forward: Optional[Callable[[], Callable]] = None

    def forward(self) -> Optional[Callable]:
        """The one-token forward for make_forward's `step` (None: the XLA step)."""
        return None if self.make_forward is None else self.make_forward()


XLA = StepChoice()


def _asked(family, options) -> tuple[Any, Optional[str]]:
    """(the family's fast step options.step asks for, None), or (None, why the family has none
    of that name); (None, None) for the XLA step."""
    if options.step == "xla":
        return None, None
    fast = family.fast_step
    if fast is None or fast.name != options.step:
        return None, f"the {family.name} family has no {options.step!r} step"
    return fast, None


def _rule(options, why: Optional[str]) -> bool:
    """Whether the fast step options.step asked for runs, given why it cannot (None: it can).
    Where it cannot, the XLA step runs and the reason is logged once per process."""
    if why is None:
        return True
    if why not in _LOGGED:
        _LOGGED.add(why)
        log.warning("step=%r runs the XLA step: %s", options.step, why)
    return False


def choose_step(family, layout, mesh, options, params) -> StepChoice:
    """The step a decoder of `family`'s model split as `layout` on `mesh` runs with `options`
    (resolved) and `params` (its placed parameters)."""
    fast, why = _asked(family, options)
    if fast is None and why is None:
        return XLA
    if fast is not None:
        why = fast.reason(family, layout, mesh, options, params)
    if not _rule(options, why):
        return StepChoice("xla", why)
    return StepChoice(fast.name, None, functools.partial(fast.make_forward, family, layout,
                                                          options))


def params_for_step(family, config, mesh, options, params) -> Any:
    """params as the step options.step asks for wants them (its prepare_params: Llama's
    persistent step moves dense bf16 projections to rows in place where it would then run),
    else params as they are. For callers that own the params (the CLI); a Decoder never
    changes the params it is given."""
    fast, _ = _asked(family, options)
    if fast is None:
        return params
    return fast.prepare_params(family, config, mesh, options, params)
