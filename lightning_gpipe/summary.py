"""Lightning's model summary, with the backbone counted over all stages instead of this stage's part."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as Summary

from lightning_gpipe.pipe import GPipe

__all__ = ["PipelineSummary", "use_pipeline_summaries"]


def _counts(pipe: GPipe) -> tuple[int, int]:
    """Parameters and trainable parameters of the whole backbone; collective over the pipeline."""
    elsewhere = {id(p) for p in pipe.ties.counted_elsewhere()}  # a tied parameter counts once
    params = [p for p in pipe.parameters() if id(p) not in elsewhere]
    counts = torch.tensor([sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)])
    if pipe.group is not None:
        dist.all_reduce(counts, group=pipe.group)
    return int(counts[0]), int(counts[1])


class PipelineSummary(Summary):
    """A summary whose totals and backbone row cover every stage: each rank holds only its own stage."""

    def __init__(self, model: Any, max_depth: int, backbone: str, pipe: GPipe) -> None:
        self._backbone = backbone
        local = list(pipe.parameters())
        full_total, full_trainable = _counts(pipe)
        self._extra_total = full_total - sum(p.numel() for p in local)
        self._extra_trainable = full_trainable - sum(p.numel() for p in local if p.requires_grad)
        self._backbone_total = full_total
        super().__init__(model, max_depth)

    @property
    def param_nums(self) -> list[int]:
        nums = super().param_nums
        return [self._backbone_total if name == self._backbone else n for name, n in zip(self.layer_names, nums)]

    @property
    def total_parameters(self) -> int:
        return super().total_parameters + self._extra_total

    @property
    def trainable_parameters(self) -> int:
        return super().trainable_parameters + self._extra_trainable

    @property
    def total_layer_params(self) -> int:  # keeps the "other params" row for what lies outside all layers only
        return super().total_layer_params + self._extra_total


class _PipelineSummaryCallback:
    """Mixed into the Trainer's ModelSummary callbacks while a pipeline runs: ``_summary`` counts all stages."""

    def _summary(self, trainer: Any, pl_module: Any) -> Summary:
        strategy = trainer.strategy
        pipe = getattr(strategy, "pipe", None)
        if pipe is None:
            return super()._summary(trainer, pl_module)  # type: ignore[misc]
        return PipelineSummary(pl_module, self._max_depth, strategy.backbone, pipe)  # type: ignore[attr-defined]


def use_pipeline_summaries(callbacks: list[Any]) -> None:
    """Make the model-summary callbacks among ``callbacks`` count the whole pipeline.

    Lightning adds its ``ModelSummary`` callback itself and offers no hook to change what it counts, so
    this swaps the class of those instances (keeping their settings) for a subclass that overrides
    ``ModelSummary._summary``, the one method that builds the summary.
    """
    for callback in callbacks:
        if isinstance(callback, ModelSummary) and not isinstance(callback, _PipelineSummaryCallback):
            cls = type(callback)
            callback.__class__ = type(f"Pipeline{cls.__name__}", (_PipelineSummaryCallback, cls), {})
