"""When one rank fails, every rank of the job learns which stage failed and exits within a bounded time.

A failing rank writes its error to the process group's key-value store (first writer wins). The
others see it in two places: the pipeline's own waits check the store while they wait, and a
watchdog thread ends a process that stays blocked elsewhere (in a collective of Lightning's, say)
for longer than a grace period after a failure was published.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Optional

import torch.distributed as dist

__all__ = ["PipelineError", "FailureBoard"]

_KEY = "failed"


class PipelineError(RuntimeError):
    """Another stage of the pipeline failed, or a stage could not be reached; the message names it."""


def _default_store() -> Optional[dist.Store]:
    # torch has no public accessor for the default group's store; this one helper is the only place
    # that reaches for the private one, so a torch upgrade breaks here and nowhere else.
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class FailureBoard:
    """Publishes and polls the first failure of a job over the default process group's store.

    >>> board = FailureBoard(store=None, rank=0, describe=lambda r: f"stage {r}")  # no store: a no-op
    >>> board.failure() is None
    True
    """

    def __init__(self, store: Optional[dist.Store], rank: int, describe, namespace: str = "lightning_gpipe") -> None:
        self._store = dist.PrefixStore(namespace, store) if store is not None else None
        self.rank = rank
        self.describe = describe
        self._published = False
        self._last_poll = 0.0
        self._cached: Optional[str] = None
        self._watchdog: Optional[threading.Thread] = None
        self._stop = threading.Event()

    @classmethod
    def for_default_group(cls, describe, namespace: str) -> "FailureBoard":
        """A board on the default group's store; a no-op outside ``torch.distributed``."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, describe, namespace)
        return cls(_default_store(), dist.get_rank(), describe, namespace)

    def publish(self, error: BaseException) -> None:
        """Tell the other ranks that this rank failed with ``error``; only the first failure is kept."""
        if self._store is None or self._published:
            return
        self._published = True
        if isinstance(error, PipelineError):
            return  # a consequence of another rank's failure, which is already on the board
        message = f"{self.describe(self.rank)} (rank {self.rank}) failed: {type(error).__name__}: {error}"
        try:
            self._store.compare_set(_KEY, "", message)
        except Exception:  # the store itself may be gone (its host died); nothing more can be said
            pass

    def failure(self, every: float = 0.0) -> Optional[str]:
        """The published failure of another rank, if any; polls the store at most once per ``every`` seconds."""
        if self._store is None:
            return None
        if self._cached is None:
            now = time.monotonic()
            if now - self._last_poll < every:
                return None
            self._last_poll = now
            try:
                if self._store.check([_KEY]):
                    self._cached = self._store.get(_KEY).decode()
            except Exception as error:  # the store's host (rank 0) is gone
                self._cached = f"the job's store could not be reached ({type(error).__name__}: {error}); rank 0 died?"
        return self._cached

    def raise_if_failed(self, every: float = 0.0) -> None:
        """Raise :class:`PipelineError` if another rank published a failure."""
        message = self.failure(every)
        if message is not None and not self._published:
            raise PipelineError(message)

    def start_watchdog(self, grace: float, poll: float = 0.5) -> None:
        """End this process ``grace`` seconds after another rank's failure if it has not ended by itself."""
        if self._store is None or self._watchdog is not None:
            return
        self._stop.clear()

        def watch() -> None:
            while not self._stop.wait(poll):
                message = self.failure()
                if message is None or self._published:
                    continue
                if self._stop.wait(grace) or self._published:
                    return
                sys.stderr.write(
                    f"[lightning_gpipe] rank {self.rank}: ending this process, {grace:.0f}s after another rank "
                    f"failed and this one stayed blocked.\n{message}\n"
                )
                traceback.print_stack(sys._current_frames().get(threading.main_thread().ident), file=sys.stderr)
                sys.stderr.flush()
                os._exit(1)

        self._watchdog = threading.Thread(target=watch, name="lightning-gpipe-watchdog", daemon=True)
        self._watchdog.start()

    def stop_watchdog(self) -> None:
        """Stop watching: the run ended normally."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
            self._watchdog = None
