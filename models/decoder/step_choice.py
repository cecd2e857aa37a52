"""Which step runs a decoder's one-token calls, decided here and nowhere else: the XLA step (the
model's forward) or the family's fast step (ModelFamily.fast_step; Llama's: the persistent step,
llama/step.py), as DecodeOptions.step asks.

The Decoder resolves it once, in its __init__ (choose_step), into a StepChoice: its executables
hand the choice's forward to the model's forward (make_forward's `step`), Decoder.step_kind and
Decoder.step_reason read it, and the CLI prints it (StepChoice.describe). The rule:

  "xla"         the XLA step.
  "persistent"  the fast step of that name where the family has it and its reason() is None,
                its CPU reference allowed (on CPU host devices the op's C++ handler runs it,
                slowly: how CI and a user without a GPU test it); otherwise ValueError at the
                Decoder's construction, saying why. Never a silent fallback.
  "auto"        the family's fast step where its reason() is None without the CPU reference
                (so on a GPU only, never the reference), else the XLA step; step_reason says
                why either way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

AUTO_RUNS = "auto: the {name} step serves this decoder"


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """The step a decoder's one-token calls run. kind: "xla" or the fast step's name
    ("persistent"); reason: why this step runs where options.step did not name it ("auto": why
    the fast step does or does not serve the decoder), None where it runs the step named;
    make_forward: () -> the fast step's one-token forward (None: the XLA step's, the model's
    forward); detail: how the fast step runs here (e.g. "CUDA kernel, TP=2, sifar inside"), ""
    for the XLA step."""

    kind: str = "xla"
    reason: Optional[str] = None
    make_forward: Optional[Callable[[], Callable]] = None
    detail: str = ""

    def forward(self) -> Optional[Callable]:
        """The one-token forward for make_forward's `step` (None: the XLA step)."""
        return None if self.make_forward is None else self.make_forward()

    def describe(self) -> str:
        """One line: the step, how it runs, and why (the CLI's device line)."""
        notes = [n for n in (self.detail, self.reason) if n]
        return self.kind + (f" ({'; '.join(notes)})" if notes else "")


XLA = StepChoice()


def _fast(family, options) -> Any:
    """The family's fast step options.step asks for (None for "xla"); ValueError where
    "persistent" names a step the family does not have."""
    if options.step == "xla":
        return None
    fast = family.fast_step
    if options.step == "auto":
        return fast
    if fast is None or fast.name != options.step:
        raise ValueError(f"step={options.step!r}: the {family.name} family has no "
                         f"{options.step!r} step (step='auto' or 'xla' run the XLA step)")
    return fast


def choose_step(family, layout, mesh, options, params) -> StepChoice:
    """The step a decoder of `family`'s model split as `layout` on `mesh` runs with `options`
    (resolved) and `params` (its placed parameters); ValueError where options.step names a step
    that cannot serve it (the module's rule)."""
    fast = _fast(family, options)
    if fast is None:
        return XLA if options.step == "xla" else StepChoice(
            "xla", f"auto: the {family.name} family has no fast one-token step")
    auto = options.step == "auto"
    why = fast.reason(family, layout, mesh, options, params, reference=not auto)
    if why is not None:
        if auto:
            return StepChoice("xla", f"auto: {why}")
        raise ValueError(f"step={options.step!r} cannot run this decoder: {why} (step='auto' "
                         f"runs the XLA step where it cannot)")
    return StepChoice(fast.name, AUTO_RUNS.format(name=fast.name) if auto else None,
                      functools.partial(fast.make_forward, family, layout, options, mesh=mesh),
                      fast.describe(layout, mesh, options))


def params_for_step(family, config, mesh, options, params) -> Any:
    """params as the fast step options.step asks for ("persistent", or "auto" where it would
    choose it) wants them (its prepare_params: Llama's persistent step moves dense bf16
    projections to rows in place where it would then run), else params as they are. For
    callers that own the params (the CLI); a Decoder never changes the params it is given."""
    try:
        fast = _fast(family, options)
    except ValueError:  # the Decoder says so
        return params
    if fast is None:
        return params
    return fast.prepare_params(family, config, mesh, options, params)
