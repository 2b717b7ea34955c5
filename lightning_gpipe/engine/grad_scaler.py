"""Loss scaling in a pipeline: one inf/NaN verdict for every stage, so one skipped step and one scale.

float16 mixed precision scales the loss so that small gradients survive float16, and a ``GradScaler`` skips the
optimizer step (and halves the scale) when any gradient came out inf or NaN. Each rank of a pipeline holds one
stage's gradients, so a scaler per stage would judge its own stage alone: an overflow in stage 0's weight
gradients would skip stage 0's step and halve stage 0's scale while stage 1 stepped, and from then on the stages
would scale the same loss by different factors and unscale gradients by a scale they were not scaled with. One
device judges every gradient at once.

Once a pipeline of several stages is built (:data:`~lightning_gpipe.engine.pipe.on_pipeline_built`), torch's
``GradScaler._unscale_grads_``, the check that both ``unscale_`` and a fused optimizer's step go through, is
:func:`_unscale_grads_`: torch's check, then the largest verdict over the stages of the pipeline the optimizer
trains (:func:`~lightning_gpipe.engine.gradients.owning_pipe`: the live one, also on a stage whose optimizer holds
none of its parameters). Every stage then skips or steps alike and moves its scale alike, as one device does; a
scaler whose optimizer no live pipeline trains keeps torch's own verdict. This serves Lightning's
``precision="16-mixed"`` and a plain-PyTorch loop with ``torch.amp.GradScaler`` alike; it is collective over the
stages, so every stage unscales and steps each optimizer, in the same order, as such loops do.

Written by hand because torch's ``GradScaler`` has no process group (DDP needs none: its gradients are already
all-reduced, so every replica finds the same infs) and no hook for its verdict.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine import distributed
from lightning_gpipe.engine.gradients import owning_pipe
from lightning_gpipe.engine.pipe import GPipe, on_pipeline_built

__all__ = ["loss_scale_state", "route_grad_scaler", "routed"]

#: torch's ``GradScaler._unscale_grads_``, kept while :func:`_unscale_grads_` stands in for it
_torch_unscale_grads: Optional[Callable[..., dict[torch.device, Tensor]]] = None


def routed() -> bool:
    """Whether torch's ``GradScaler`` joins its inf/NaN verdict over the stages of a live pipeline in this process."""
    return getattr(torch.amp.GradScaler, "_unscale_grads_", None) is _unscale_grads_


def route_grad_scaler() -> bool:
    """Make torch's ``GradScaler`` join its verdict over the stages (idempotent); called when a pipeline is built.

    Returns False, with a warning, where this torch's ``GradScaler`` has no ``_unscale_grads_`` to stand in for.
    """
    global _torch_unscale_grads
    if routed():
        return True
    original = getattr(torch.amp.GradScaler, "_unscale_grads_", None)
    if original is None:
        warnings.warn(
            f"torch {torch.__version__}'s GradScaler has no _unscale_grads_, so under float16 mixed precision each "
            "stage of a pipeline would skip steps and move its loss scale on its own stage's gradients alone. Use "
            "bfloat16 (precision='bf16-mixed'), which needs no loss scaling.",
            stacklevel=2,
        )
        return False
    _torch_unscale_grads = original
    torch.amp.GradScaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]
    return True


def _unscale_grads_(
    self: Any, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
) -> dict[torch.device, Tensor]:
    """torch's check of ``optimizer``'s gradients, then the largest verdict over the stages of its pipeline."""
    assert _torch_unscale_grads is not None  # set with the routing
    found = _torch_unscale_grads(self, optimizer, inv_scale, found_inf, allow_fp16)
    pipe = owning_pipe([p for group in optimizer.param_groups for p in group["params"]])
    if pipe is None:
        return found
    return _joined(found, pipe)


def _joined(found: dict[torch.device, Tensor], pipe: GPipe) -> dict[torch.device, Tensor]:
    """The verdicts of this stage's devices, and the other stages', as one (on the pipeline's device)."""
    verdict = torch.zeros((), dtype=torch.float32, device=pipe.device)
    for value in found.values():  # none where this stage's optimizer holds no gradient: it joins with 0
        verdict += value.to(pipe.device)
    watch = pipe.watch("the GradScaler's check for inf and NaN gradients over all stages")
    distributed.all_reduce(verdict, dist.ReduceOp.MAX, pipe.group, watch)
    return {verdict.device: verdict}


def loss_scale_state(scaler: Any) -> Optional[tuple[float, int]]:
    """The scale and the growth tracker of an enabled ``GradScaler`` (``None`` otherwise): what the stages compare
    before each step, since a scale changed on some ranks only would scale and unscale the stages differently."""
    if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
        return None
    return float(scaler.get_scale()), int(scaler._get_growth_tracker())


def _on_pipeline_built(pipe: GPipe) -> None:
    route_grad_scaler()


on_pipeline_built.append(_on_pipeline_built)
