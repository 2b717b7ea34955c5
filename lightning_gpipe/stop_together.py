"""Every rank stops where any rank was asked to: ``trainer.should_stop`` agreed over the job.

Lightning's loops read ``trainer.should_stop`` on each rank for itself, and only its own stopping
callbacks (``EarlyStopping``, the ``Timer``) agree on it over the ranks first. A callback of the user's
that sets it on some ranks only (under ``@rank_zero_only``: a custom early stop, a NaN or time guard)
ends the fit on those ranks alone. Under DDP that hangs the next collective; in a pipeline the other
stages would wait for the stopped one's activations. One device stops. So the strategy adds this
callback, which makes the decision the job's (any rank's ``True``) at the ends of a training batch and of
an epoch, after every other callback's hook of the same name, and the strategy does the same after the
module's and the callbacks' ``on_train_start`` and ``on_validation_end`` (hooks a strategy gets last).

What it cannot reach is the LightningModule's own ``on_train_batch_end`` and ``on_train_epoch_end``,
which Lightning calls after every callback: a stop set there on some ranks only is left to
:mod:`~lightning_gpipe.engine.deadlock`, which ends the run with an error naming the ranks' waits.

At the end of each validation, test and predict batch, where the loops read no stop but do read SIGTERM's flag, it
makes the signals any rank got (SIGTERM, SLURM's requeue signal) every rank's (see :mod:`~lightning_gpipe.sigterm`).
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

__all__ = ["StopTogether"]


class StopTogether(Callback):
    """Replace ``trainer.should_stop`` with ``agree(trainer.should_stop)`` where the loops read it next; call
    ``agree_on_signals()`` after each evaluation and prediction batch."""

    def __init__(self, agree: Callable[[bool], bool], agree_on_signals: Callable[[], None]) -> None:
        self.agree, self.agree_on_signals = agree, agree_on_signals

    def _agree(self, trainer: "pl.Trainer") -> None:
        trainer.should_stop = self.agree(trainer.should_stop)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        self._agree(trainer)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._agree(trainer)

    def on_validation_batch_end(self, *args: Any) -> None:
        self.agree_on_signals()

    def on_test_batch_end(self, *args: Any) -> None:
        self.agree_on_signals()

    def on_predict_batch_end(self, *args: Any) -> None:
        self.agree_on_signals()
