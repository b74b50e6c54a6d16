"""The immutable plan of a kernel call, and the facts it is decided from.

NOTE: [The planning stage]
A kernel call decides many things before it computes anything: which of the ``vmap_axes`` checks
run, whether vmap can map the examples or a Python loop must (NOTE: [Switching to example
loops]), whether the whole-batch forward pass is needed or the outputs' remembered shapes stand
in for it (NOTE: [Remembered output shapes]), how many examples one per-example pass holds
(NOTE: [Working-set runs]), which implementation runs and with which ``chunk_size`` (AUTO and
NOTE: [Memory plans]). None of these depends on tensor values, so each is decided once per key
(NOTE: [Plan keys]) and kept in a :class:`CallPlan`:

* :class:`Facts` are what the first calls with a key learnt about the model: the checks that
  passed, the outputs' description, whether vmap failed. They only ever grow.
* A :class:`CallPlan` is decided from the facts and the kernel function's options for one
  :class:`Purpose` (the NTK alone, the NTK and the NNGP, ``batch``'s spans): the checks to run,
  the example loop, the stand-in outputs. Once the first call with it has run, the plan also
  holds what that call prepared that a later call can reuse (:class:`CallTemplate`).
* The memory plan (AUTO's pick and the ``chunk_size``, NOTE: [Memory plans]) is kept beside it
  per key and budget (:meth:`Planner.memory_plan`): it is made after the call is prepared, and a
  default budget moves with the free memory.
* A warm call is the key's lookup, the binding of its tensors to the template (the model's
  private copies, both sides) and the plan's execution: no forward pass, no check, no decision.

``_kernel/`` runs the stage (``preparation.py`` prepares a call from its plan, ``execution.py``
computes it; :class:`~torchntk._plan.stage.Planner` holds the plans of one kernel function);
``batch`` asks the same settings for its spans. A plan is replaced, never
changed: a new fact (a switch to the example loop) makes a new plan, and so does a memory plan
that no longer fits the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

__all__ = ["CallPlan", "CallTemplate", "Facts", "Purpose", "UNDECIDED"]

UNDECIDED = "undecided"
""":attr:`Facts.found_axes` before the key's first call decided them."""


@dataclass(frozen=True)
class Facts:
    """What earlier calls with one key learnt (NOTE: [The planning stage]).

    Attributes:
        derivatives_checked: the derivative part of NOTE: [Checking vmap_axes] passed.
        aliases_checked: NOTE: [Aliased parameters]'s check of the module's parameter references passed.
        outputs: the description of the outputs (``OutputShapes``) that later calls may stand in
            with, or None.
        example_loop: vmap cannot evaluate the model; examples are mapped by a loop.
        found_axes: with ``vmap_axes="auto"``, the ``vmap_axes`` found for the key (NOTE: [Found
            vmap_axes]: ``ParsedVmapAxes``, or None where the examples are not mapped), or
            :data:`UNDECIDED` before its first call.
        found_reason: why no axes were found, or why the found ones map the examples by a loop
            (NOTE: [Loop or whole batches]); None when they were found and vmap maps them, or not decided.
    """

    derivatives_checked: bool = False
    aliases_checked: bool = False
    outputs: Any = None
    example_loop: bool = False
    found_axes: Any = "undecided"
    found_reason: Optional[str] = None

    def learnt(self, **facts: Any) -> "Facts":
        return replace(self, **facts)


@dataclass(frozen=True)
class Purpose:
    """What a call computes, which decides what it must prepare.

    Attributes:
        maps_examples: ``vmap_axes`` map the examples of this call (the kernel function has them
            and the call computes the NTK, or a batched NNGP): the ``vmap_axes`` checks apply.
        for_ntk: ``vmap_axes`` matter (the NTK, or a batched NNGP).
        computes_ntk: the NTK is computed (its implementations run, which may take the output check
            from their own per-example passes).
        needs_outputs: the outputs' values are needed (the NNGP), not only their shapes.
        forward_run_length: whole-batch forward passes by runs of this many examples (``batch``).
        admit: refuse an NTK larger than the memory budget before the forward passes.
        checks: ``check_vmap_axes`` as validated: True (the output check on every call), ``"first"``
            (every check on the first call per key) or False. A captured kernel's replays are
            traced without the output check, from the same facts.
    """

    maps_examples: bool = True
    for_ntk: bool = True
    computes_ntk: bool = True
    needs_outputs: bool = False
    forward_run_length: Optional[int] = None
    admit: bool = False
    checks: Union[bool, str] = True


@dataclass(frozen=True)
class CallTemplate:
    """What a call prepared that a later call with the same key and purpose reuses: everything
    but the tensors (its model's private copies and its inputs are never kept, so a plan holds no
    memory of the call that made it). See :meth:`KernelCall.template` in ``_call/kernel_call.py``."""

    call: Any  # the KernelCall without model, sides and pending check
    names: tuple[str, ...]  # the differentiated parameters the call had
    axes1: tuple  # (x_axes, kwarg_axes) of x1
    axes2: Optional[tuple]  # the same for x2, None when x2 is None
    out_axes: tuple  # the outputs' batch axes
    survey: Any = None  # the module's KeptSurvey (NOTE: [Module surveys]), which the key vouches for


@dataclass(frozen=True)
class CallPlan:
    """The decisions of NOTE: [The planning stage] for one key and purpose.

    Attributes:
        check_outputs: compare the per-example outputs with the whole-batch outputs.
        outputs_in_kernel: leave that comparison to the implementation, which makes per-example
            passes anyway (``KernelCall.vmap_check``); a first call runs it while the call is
            prepared, so that its failures are explained in order.
        check_derivatives: run the derivative check of ``vmap_axes`` (first calls only).
        derivatives_deferred: leave that check to the plan of the implementation
            (``KernelCall.derivative_check``, NOTE: [The derivative check within a plan's check]).
        check_aliases: watch the model's parameter references (first calls only).
        example_loop: map the examples with a Python loop instead of vmap.
        outputs: the remembered outputs' description that stands in for the whole-batch forward
            pass, or None (the pass runs).
        template: what the first call prepared, for warm calls; None until one has run, and for
            calls that need more than the outputs' shapes.
        working_runs: NOTE: [Working-set runs]'s run length, decided with the template.
    """

    check_outputs: bool
    check_derivatives: bool
    check_aliases: bool
    example_loop: bool
    outputs: Any = None
    outputs_in_kernel: bool = False
    template: Optional[CallTemplate] = None
    working_runs: Optional[int] = None
    derivatives_deferred: bool = False

    @property
    def warm(self) -> bool:
        """Whether a call can bind its tensors to the template instead of being prepared."""
        return self.template is not None
