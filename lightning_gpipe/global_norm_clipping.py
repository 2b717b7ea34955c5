"""Gradient clipping by norm, in a pipelined run, by the norm over every stage instead of this stage's alone."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from lightning_gpipe.engine.gradients import clip_grad_norm_
from lightning_gpipe.engine.pipe import GPipe

__all__ = ["GlobalNormClipping"]


class GlobalNormClipping:
    """Mixed into the run's precision plugin: norm clipping by the norm over every stage, not this stage's.

    Lightning clips through ``precision_plugin.clip_grad_by_norm(optimizer, clip_val)``, a public method
    with no strategy hook around it, and builds the plugin itself from ``precision=``; so the strategy
    runs with a copy of the plugin whose class adds this (see :mod:`lightning_gpipe._subclass`). Without
    a pipeline (another strategy's run) it clips as the plugin would.
    """

    pipeline: Callable[[], Optional[GPipe]]  # the running strategy's pipe (set with the copy)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        pipe = self.pipeline()
        if pipe is None:
            return super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]  # the plugin's own class
        main_params = self.main_params(optimizer)  # type: ignore[attr-defined]
        clip_grad_norm_(main_params, clip_val, pipe=pipe)  # what `lightning_gpipe.clip_grad_norm_` does
