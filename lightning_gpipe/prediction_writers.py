"""Lightning's prediction writers in a pipeline: each pipeline's predictions are written once, from its first stage.

Every stage of a pipeline holds the same predictions (the backbone returns the real output on every rank), so a
``BasePredictionWriter`` that writes on every rank, as Lightning's own example does
(``torch.save(predictions, f"predictions_{trainer.global_rank}.pt")``), would write each pipeline's predictions
once per stage: K identical files, and every sample K times in what a user joins from them. So on the other stages
the writer's ``write_on_batch_end`` and ``write_on_epoch_end`` do nothing. The files are then what DDP writes, one
per data-parallel shard, each sample once; with one pipeline, one file, as on one device.

Only the writing is skipped, not the callback's hooks. A writer that calls a collective over every rank inside
``write_on_*`` (``trainer.strategy.barrier()``) waits for stages that never come: the deadlock check ends every
rank with an error that names the wait.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BasePredictionWriter

__all__ = ["write_once_per_pipeline"]


def _skipped(*args: Any, **kwargs: Any) -> None:
    """A writer's ``write_on_*`` on a stage other than the first: its pipeline's first stage writes the same."""


def write_once_per_pipeline(trainer: "pl.Trainer", first_stage: bool) -> None:
    """Make the trainer's ``BasePredictionWriter`` callbacks write on the first stage of each pipeline only.

    ``first_stage``: whether this rank is one.
    """
    if first_stage:
        return
    for writer in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(writer, BasePredictionWriter):  # instance attributes: the user's class stays as it is
            writer.write_on_batch_end = _skipped  # type: ignore[method-assign]
            writer.write_on_epoch_end = _skipped  # type: ignore[method-assign]
