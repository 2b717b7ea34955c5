"""SLURM's requeue signal saves the whole model and requeues the job with every rank at one step.

On SLURM, Lightning's ``SLURMEnvironment(auto_requeue=True)`` (its default there) handles the requeue signal
(``--signal=USR1@90``: shortly before the time limit) inside the signal handler: it finalizes the loggers, calls
``trainer.save_checkpoint`` and, on rank 0, ``scontrol requeue``. A signal handler runs wherever the signal finds
its process. In a pipeline ``save_checkpoint`` is collective (the stages gather the whole model), so the ranks met
in it only where the signal found each of them at a matching point: measured on CPU-2 with two tasks started as
``srun`` starts them and the signal sent to both, a run without sleeps ended at once with a gloo abort ("Received
data size doesn't match expected size. Is there a distributed collective mismatch"), which named no cause.

Here the handler only notes the signal. The gathers that carry a SIGTERM's note (:mod:`~lightning_gpipe.sigterm`: the
stop decision at the end of each training batch, epoch and validation, and the end of each validation, test and
predict batch) carry this one too; once any rank has one, every rank runs Lightning's handler at that same point, with
rank 0's checkpoint path, after an optimizer step (within ``accumulate_grad_batches``, at the batch that steps). The
checkpoint then holds one step on every stage and resumes exactly. The job goes on afterwards, as under Lightning,
until SLURM ends it.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Callable, Optional

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_prefixed_message

from lightning_gpipe import _lightning

__all__ = ["RequeueTogether"]

log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")


class RequeueTogether:
    """This rank's side of a requeue: noted by :meth:`notify`, run on every rank at once by :meth:`run`."""

    def __init__(self) -> None:
        self.trainer: Optional[pl.Trainer] = None
        self.signal = 0  # the environment's requeue signal
        self.signum: Optional[int] = None  # the requeue signal this rank got; the job has not acted on it yet

    @property
    def noted(self) -> bool:
        return self.signum is not None

    def notify(self, signum: int, _: Optional[FrameType]) -> None:
        """Note the signal (in the main thread, wherever it was): no collective inside a signal handler."""
        if self.trainer is not None:
            message = f"Received the requeue signal {signum}: every rank saves and requeues at the next step"
            log.info(rank_prefixed_message(message, self.trainer.local_rank))
            self.signum = signum

    def run(self, path_from_rank_zero: Callable[[Callable[[], str]], str]) -> None:
        """Lightning's requeue handler on every rank, at the same point; collective (the checkpoint and its path).

        Not while gradients wait for an optimizer step (``accumulate_grad_batches``): the checkpoint would lose them,
        and its resume would step without them. The note stays, and the next point (the batch that steps) acts on it.
        ``path_from_rank_zero`` computes the given function on rank 0 and gives its value to every rank.
        """
        trainer = self.trainer
        assert trainer is not None
        if _lightning.mid_accumulation(trainer):  # the same on every rank: their loops are at the same batch
            return
        signum = self.signum if self.signum is not None else self.signal  # the rank the signal did not reach
        self.signum = None  # a later signal requeues again, as under Lightning
        path = path_from_rank_zero(lambda: _lightning.hpc_save_path(trainer))
        _lightning.requeue_as_lightning_does(trainer, signum, path)

    def install(self, trainer: pl.Trainer, environment: Optional[ClusterEnvironment], world_size: int) -> None:
        """Take the place of Lightning's requeue handler, before the Trainer registers its signal handlers, where
        Lightning would register one (SLURM with ``auto_requeue``) and the job has several processes."""
        self.signum = None
        if world_size > 1 and isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self.trainer = trainer
            self.signal = int(environment.requeue_signal or 0)
            _lightning.replace_requeue_handler(trainer, self.notify)

    def uninstall(self) -> None:
        if self.trainer is not None:
            _lightning.replace_requeue_handler(self.trainer, None)
        self.trainer = None
