"""SIGTERM (a scheduler's preemption, a ``kill``) stops every rank of the job at the same step, as it stops one device.

On one device Lightning's SIGTERM handler sets a flag, and the loops raise ``SIGTERMException`` at the next batch:
callbacks' ``on_exception`` run (``OnExceptionCheckpoint`` writes its checkpoint) and the process ends. Over several
processes Lightning's handler also calls ``torch.distributed.broadcast`` from inside the signal handler, on each rank
that gets the signal, wherever that rank is. In a pipeline that broadcast meets another collective, or none: measured
with SIGTERM sent to every process of a K=2 job under the subprocess launcher, the job ended only after 30-36 s,
through the deadlock or out-of-step check, with an error that blamed a rank-zero-only callback; sent to one stage's
process, the same.

Here the handler only notes the signal (and forwards it to the launcher's children, as Lightning's does). The job's
stop decision (:mod:`~lightning_gpipe.stop_together`'s gather, at the end of each training batch, epoch and
validation), and a gather at the end of each validation, test and predict batch, carry the note; once any rank has
one, every rank sets Lightning's flag at that same point, so each raises ``SIGTERMException`` at the same place of its
loop (the next training batch, or the next evaluation batch, as one device does; the predict loop reads no flag).
That exception is then no failure: the ranks' collectives still meet, so ``OnExceptionCheckpoint`` writes the whole
model and the backbone is put back together, as on one device.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_gpipe import _lightning

__all__ = ["SigtermStop"]

#: Lightning's own notifier logs here; so does this one, so that the message reads as it does without the pipeline
log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")


class SigtermStop:
    """This rank's side of a stop on SIGTERM: noted by :meth:`notify`, agreed on by the strategy's stop decision."""

    def __init__(self) -> None:
        self.trainer: Optional[pl.Trainer] = None
        self.noted = False  # this rank got SIGTERM; the job has not decided yet
        self.agreed = False  # the job decided: every rank raises SIGTERMException at the same point

    def notify(self, signum: int, _: Optional[FrameType]) -> None:
        """Lightning's SIGTERM notifier without its broadcast (see the module's docstring); runs in the main thread."""
        trainer = self.trainer
        if trainer is None:
            return
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        if not self.noted:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the launcher's children get it too (under the subprocess launcher)
        self.noted = True
        if trainer.world_size == 1:  # no decision to share
            self.agree()

    def agree(self) -> None:
        """Every rank calls this at the same point, once any rank noted SIGTERM: the loops now stop alike."""
        self.agreed = True
        if self.trainer is not None:
            self.trainer._signal_connector.received_sigterm = True

    def is_agreed_stop(self, exception: BaseException) -> bool:
        """Whether ``exception`` is the loops' way of stopping on an agreed SIGTERM: every rank raised it at the same
        point, so it is not a failure to tell the other ranks of."""
        return self.agreed and isinstance(exception, SIGTERMException)

    def install(self, trainer: pl.Trainer) -> None:
        """Take the place of Lightning's notifier, before the Trainer registers its signal handlers."""
        self.trainer = trainer
        self.noted = self.agreed = False
        _lightning.replace_sigterm_notifier(trainer, self.notify)

    def uninstall(self) -> None:
        if self.trainer is not None:
            _lightning.replace_sigterm_notifier(self.trainer, None)
        self.trainer = None
