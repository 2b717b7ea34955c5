"""torch's own ``clip_grad_norm_`` in a pipeline: its norm is taken over every stage, as one device takes it.

Each rank holds one stage, so ``torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)`` in user code
(``on_before_optimizer_step``, ``configure_gradient_clipping``, a manual-optimization step) would compute this
stage's norm and clip each stage by its own factor: no error, and the weights 3.3e-2 off one device after a few
steps. It is the most common clipping code there is, and it is often bound by ``from torch.nn.utils import
clip_grad_norm_`` before this package is imported, so replacing the public name would miss it.

torch's function looks up its norm helper, ``torch.nn.utils.clip_grad._get_total_norm``, in its own module at
every call. Once a pipeline of several stages is built (:data:`~lightning_gpipe.engine.pipe.on_pipeline_built`),
that helper is :func:`_total_norm`, which joins the stages' shares as :func:`lightning_gpipe.clip_grad_norm_` does
(this stage's gradients, the gradients every stage holds alike counted once, each tied parameter once). The
clipping itself stays torch's: every stage scales by the one factor. With no such pipeline live, the helper calls
torch's own.

The same helper is torch's public ``torch.nn.utils.get_total_norm``, the first half of the two-step clipping that
torch documents (``get_total_norm``, then ``clip_grads_with_norm_`` with that norm) and what code logs as the
gradient norm. Called on one stage's gradients it gave that stage's norm: each stage clipped by its own (2.2e-2
off one device after 8 steps in a probe, K=2) and rank 0 logged stage 0's. So that public name, and any module's
own binding of it (``from torch.nn.utils import get_total_norm`` runs before the pipeline exists), become
:func:`_get_total_norm`, the same norm under its own name in the messages; torch's modules keep theirs.

torch's ``clip_grad_value_`` needs no norm, but it fails on a list without gradients (torch 2.14: "Expected
!nested_tensorlist[0].empty()"), which one device never gives it and a stage with nothing to train does (a frozen
first stage, a stage of activations only): ``Trainer(gradient_clip_algorithm="value")`` stopped the run there. Its
public name and the bindings of it become :func:`_clip_grad_value`, which clamps nothing where a live pipeline's
stage holds no gradient, and is torch's own otherwise.

Written by hand because neither torch nor Lightning has a hook for it: Lightning's own clipping
(``gradient_clip_val``) goes through the strategy's precision plugin, which this package routes already, but
torch's function is plain code. Like :func:`lightning_gpipe.clip_grad_norm_`, it is then collective over the
stages: call it on every rank, as hook code does.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.utils.clip_grad as torch_clip_grad
from torch import Tensor

from lightning_gpipe.engine import clipping
from lightning_gpipe.engine.gradients import owning_pipe
from lightning_gpipe.engine.pipe import GPipe, live_pipes, on_pipeline_built

__all__ = ["route_torch_clip_grad_norm", "routed"]


def routed() -> bool:
    """Whether torch's ``clip_grad_norm_`` takes its norm over every stage of a live pipeline in this process."""
    return getattr(torch_clip_grad, "_get_total_norm", None) is _total_norm


def route_torch_clip_grad_norm() -> bool:
    """Make torch's ``clip_grad_norm_`` take its norm over the stages of the live pipeline (idempotent).

    Called when a pipeline of several stages is built. Returns False, with a warning that says what to use
    instead, where this torch's ``clip_grad_norm_`` no longer looks up ``_get_total_norm`` in its module.
    """
    if routed():
        return True
    helper = getattr(torch_clip_grad, "_get_total_norm", None)
    function = getattr(torch_clip_grad.clip_grad_norm_, "__wrapped__", torch_clip_grad.clip_grad_norm_)
    code = getattr(function, "__code__", None)
    if helper is None or code is None or "_get_total_norm" not in code.co_names:
        warnings.warn(
            f"torch {torch.__version__}'s torch.nn.utils.clip_grad_norm_ no longer computes its norm through "
            "torch.nn.utils.clip_grad._get_total_norm, so in a pipeline it would clip each stage by that stage's own "
            "norm. Use lightning_gpipe.clip_grad_norm_ (same arguments) or Trainer(gradient_clip_val=...) instead.",
            stacklevel=2,
        )
        return False
    torch_clip_grad._get_total_norm = _total_norm
    _route_bindings(
        {"get_total_norm": (helper, _get_total_norm), "clip_grad_value_": (_TORCH_CLIP_VALUE, _clip_grad_value)}
    )
    return True


def _route_bindings(names: dict[str, tuple[Callable[..., Any], Callable[..., Any]]]) -> None:
    """Point every module-level binding of each of torch's functions outside torch at its stand-in.

    ``names`` maps a public name in ``torch.nn.utils`` to (torch's function, the stand-in). That public name first;
    then the names other modules bound to the same function, which a call looks up in their own module (a script's
    ``from torch.nn.utils import get_total_norm``), since neither torch nor Python has a hook that reaches a name
    bound before the pipeline existed. Each stand-in gives torch's own result for gradients no live pipeline holds,
    so a binding that never sees a pipeline's gradients keeps its result.
    """
    stand_ins = {id(original): stand_in for original, stand_in in names.values()}
    for public, (original, stand_in) in names.items():
        if getattr(torch.nn.utils, public, None) is original:
            setattr(torch.nn.utils, public, stand_in)
    for name, module in list(sys.modules.items()):
        if module is None or name == "torch" or name.startswith(("torch.", "lightning_gpipe.")):
            continue
        try:
            namespace: dict[str, Any] = vars(module)
        except TypeError:  # not a module: an object some library put in sys.modules
            continue
        for key, value in list(namespace.items()):
            if id(value) in stand_ins:
                namespace[key] = stand_ins[id(value)]


#: torch's own ``clip_grad_value_``, kept before :func:`_route_bindings` points its names at :func:`_clip_grad_value`
_TORCH_CLIP_VALUE: Callable[..., None] = torch_clip_grad.clip_grad_value_


def _clip_grad_value(
    parameters: Union[Tensor, Iterable[Tensor]], clip_value: Union[float, int], foreach: Optional[bool] = None
) -> None:
    """torch's ``clip_grad_value_``, which clamps nothing where none of ``parameters`` has a gradient while a pipeline
    is live (a stage with nothing to train), where torch's raises."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    if live_pipes() and all(p.grad is None for p in params):
        return None
    return _TORCH_CLIP_VALUE(params, clip_value, foreach)


def _pipeline(grads: list[Tensor]) -> Optional[GPipe]:
    """The live pipeline whose norm to join: :func:`~.gradients.owning_pipe` of the parameters that hold ``grads``."""
    ids = {id(g) for g in grads}
    held: list[Tensor] = [
        p for pipe in live_pipes() for p in pipe.parameters() if p.grad is not None and id(p.grad) in ids
    ]
    return owning_pipe(held)


def _norm_for(call: str, doc: str) -> Callable[..., Tensor]:
    """A stand-in for torch's norm helper with its signature, which :func:`_joined` waits for as ``call``."""

    def norm(
        tensors: Union[Tensor, Iterable[Tensor]],
        norm_type: Union[float, int, str] = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> Tensor:
        return _joined(tensors, norm_type, error_if_nonfinite, foreach, call)

    norm.__doc__ = doc
    return norm


#: torch's ``_get_total_norm`` of the gradients ``clip_grad_norm_`` was given, over every stage of the pipeline
_total_norm = _norm_for(
    "torch.nn.utils.clip_grad_norm_",
    "torch's ``_get_total_norm`` of the gradients ``clip_grad_norm_`` was given, over every stage (see ``_joined``).",
)
#: torch's public ``get_total_norm`` of a pipeline's gradients, over every stage
_get_total_norm = _norm_for(
    "torch.nn.utils.get_total_norm",
    "torch's public ``get_total_norm`` of a pipeline's gradients, over every stage (see ``_joined``).",
)


def _joined(
    tensors: Union[Tensor, Iterable[Tensor]],
    norm_type: Union[float, int, str],
    error_if_nonfinite: bool,
    foreach: Optional[bool],
    call: str,
) -> Tensor:
    """The norm of ``tensors`` over every stage of the pipeline whose gradients they are, or torch's own of them.

    The gradients of this stage's parameters are its share; the others (a head's, a stem's) are the same on every
    stage and count once; a tied parameter's copy that an earlier stage counts is skipped. A stage given none
    (a frozen stage) still joins, with a share of 0. Collective over the stages, waited for as ``call``.
    """
    grads = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    pipe = _pipeline(grads)
    if pipe is None:
        return clipping.TORCH_TOTAL_NORM(grads, norm_type, error_if_nonfinite, foreach)
    own_ids = {id(p.grad) for p in pipe.parameters() if p.grad is not None}
    skip = {id(p.grad) for p in pipe.ties.counted_elsewhere() if p.grad is not None}
    with torch.no_grad():
        return clipping.joined_norm(
            [g for g in grads if id(g) in own_ids and id(g) not in skip],
            [g for g in grads if id(g) not in own_ids and id(g) not in skip],
            grads,
            count_replicated=pipe.stage == 0,
            group=pipe.group,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            foreach=foreach,
            watch=pipe.watch(f"{call} (its norm over all stages)"),
            device=pipe.device,
        )


def _on_pipeline_built(pipe: GPipe) -> None:
    route_torch_clip_grad_norm()


on_pipeline_built.append(_on_pipeline_built)
