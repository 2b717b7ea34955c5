"""Loss scaling in a pipeline: one inf/NaN verdict for every stage, so one skipped step and one scale.

float16 mixed precision scales the loss so that small gradients survive float16, and a ``GradScaler`` skips the
optimizer step (and halves the scale) when any gradient came out inf or NaN. Each rank of a pipeline holds one
stage's gradients, so a scaler per stage would judge its own stage alone: an overflow in stage 0's weight
gradients would skip stage 0's step and halve stage 0's scale while stage 1 stepped, and from then on the stages
would scale the same loss by different factors and unscale gradients by a scale they were not scaled with. One
device judges every gradient at once.

:class:`JoinedInfCheck` makes a scaler's check for inf and NaN gradients, the one both ``unscale_`` and a fused
optimizer's step go through (``_unscale_grads_``), end with the largest verdict over the stages of the pipeline.
Every stage then skips or steps alike and updates its scale alike, as one device does. Written by hand because
torch's ``GradScaler`` has no process group (DDP needs none: its gradients are already all-reduced, so every
replica finds the same infs).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine import distributed
from lightning_gpipe.engine.pipe import GPipe

__all__ = ["JoinedInfCheck", "loss_scale_state"]


class JoinedInfCheck:
    """A mixin for a ``torch.amp.GradScaler`` (or a subclass of it): its check ends with the largest verdict over the
    stages of ``pipeline()``, the live pipeline (its own check where that is ``None`` or one stage).

    Collective over the stages at each ``unscale_`` (Lightning's ``MixedPrecision`` plugin calls it for every
    optimizer step, on every rank). The strategy puts it on a copy of the plugin's scaler
    (:func:`lightning_gpipe._subclass.copy_as`), which shares the scale and the per-optimizer state.
    """

    #: the live pipeline, or None; set on the copy
    pipeline: Callable[[], Optional[GPipe]]

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        found: dict[torch.device, Tensor] = super()._unscale_grads_(  # type: ignore[misc]
            optimizer, inv_scale, found_inf, allow_fp16
        )
        pipe = self.pipeline()
        if pipe is None or pipe.group is None:
            return found
        # a stage whose optimizer holds no gradient found nothing, and still joins (with 0)
        verdict = torch.zeros((), dtype=torch.float32, device=pipe.device)
        for value in found.values():
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
