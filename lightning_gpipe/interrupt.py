"""Ctrl-C (SIGINT) stops every rank of the job at the same point, so that ``OnExceptionCheckpoint`` can save.

On one device, Ctrl-C raises ``KeyboardInterrupt`` wherever the process is; Lightning catches it, runs the callbacks'
``on_exception`` (``OnExceptionCheckpoint`` writes its checkpoint, the usual way to keep a run that one stops by
hand), tears down and exits with code 1. Over the processes of a pipeline, each rank raised it at its own point: a
terminal's Ctrl-C reaches every process of the job, a ``kill -INT`` one. Measured with K=2 under Lightning's
subprocess launcher and ``OnExceptionCheckpoint``: the job exited 1 at once, and no checkpoint was written ("a stage
of the pipeline failed, and the stages' states may not belong to the same step"), where one device wrote one.

Here the first SIGINT of a process only notes it, as :mod:`~lightning_gpipe.sigterm` notes SIGTERM. The gathers that
carry SIGTERM's note (the stop decision at the end of each training batch, epoch and validation, and the end of each
validation, test and predict batch) carry this one too; once any rank has one, every rank raises
``KeyboardInterrupt`` at that same point. Lightning's handling then runs on every rank with their collectives still
meeting: the checkpoint holds every stage at one step, the backbone is put back together, and the job exits with
code 1, as on one device. A second Ctrl-C before that point raises at once, as Python's own handler does: the way
out of a pipeline that no longer reaches any such point.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_prefixed_message

from lightning_gpipe import _lightning

__all__ = ["InterruptTogether"]

#: Lightning's logger, which prints at INFO by default: the note reads beside its "Detected KeyboardInterrupt"
log = logging.getLogger("lightning.pytorch")


class InterruptTogether:
    """This rank's side of a stop on Ctrl-C: noted by :meth:`notify`, acted on at a point every rank shares."""

    def __init__(self) -> None:
        self.noted = False  # this rank got SIGINT; the job has not acted on it yet
        self.agreed = False  # every rank raised KeyboardInterrupt at the same point
        self._previous: Any = None  # the handler this one replaced; None while not installed
        self._trainer: Optional[pl.Trainer] = None
        self._rank = 0

    def install(self, trainer: pl.Trainer, world_size: int, rank: int) -> None:
        """Take the place of Python's own SIGINT handler for a run of several processes.

        Left alone: a run of one process (it has nobody to agree with), a handler the user installed, and a setup
        outside the main thread (only the main thread may set a handler; Python's then acts)."""
        self.noted = self.agreed = False
        self._rank = rank
        if world_size < 2 or self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        self._previous = signal.signal(signal.SIGINT, self.notify)
        self._trainer = trainer

    def uninstall(self) -> None:
        """Put back the handler this one replaced, unless something replaced this one since (Lightning ignores
        SIGINT while it shuts down after a ``KeyboardInterrupt``)."""
        if self._previous is None:
            return
        if signal.getsignal(signal.SIGINT) == self.notify and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
        if self._trainer is not None:  # the Trainer's signal teardown, which comes next, restores what it found
            _lightning.restore_at_signal_teardown(self._trainer, signal.SIGINT, self.notify, self._previous)
        self._previous, self._trainer = None, None
        if self.noted and not self.agreed:  # after the run's last shared point (its teardown): said, not swallowed
            log.warning(
                rank_prefixed_message(
                    "The SIGINT (Ctrl-C) came after the run's last batch, where the stages could no longer stop "
                    "together: the run finished normally. Press Ctrl-C again to stop the script.",
                    self._rank,
                )
            )

    def notify(self, signum: int, frame: Optional[FrameType]) -> None:
        """The handler; runs in the main thread. The first SIGINT is noted, a second one raises at once."""
        if self.noted:
            signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt here
        self.noted = True
        log.info(
            rank_prefixed_message(
                "Received SIGINT (Ctrl-C): every stage of the pipeline stops at the end of the current batch, all at "
                "one step, so that `OnExceptionCheckpoint` can save them alike. Press Ctrl-C again to stop this "
                "process at once.",
                self._rank,
            )
        )
        sys.stderr.flush()

    def stop_here(self) -> None:
        """Every rank calls this at the same point, once any rank noted SIGINT: raise as Python's handler would."""
        self.agreed = True
        raise KeyboardInterrupt

    def is_agreed_stop(self, exception: BaseException) -> bool:
        """Whether ``exception`` is :meth:`stop_here`'s: every rank raised it at the same point, so it is not a
        failure to tell the other ranks of."""
        return self.agreed and isinstance(exception, KeyboardInterrupt)
