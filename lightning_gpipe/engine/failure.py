"""When one rank fails, every rank of the job learns which stage failed and exits within a bounded time.

A failing rank writes its error to the process group's key-value store (first writer wins). A
killed rank cannot write: its neighbours notice its closed connections at once, and heartbeats
notice a rank that is gone or frozen within ``failure_timeout`` seconds; either way the failure is
published on its behalf. The store is only ever touched by a background poller thread, never by
the training thread, because a store whose host died can block a caller for the whole store
timeout; the training thread reads the poller's findings from memory. A watchdog thread ends a
process that stays blocked elsewhere (in a collective of Lightning's, say) for longer than a grace
period after a failure was published, and treats a store that stops answering as a failure of
rank 0, which hosts it.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn, Optional

import torch.distributed as dist

from lightning_gpipe.engine.deadlock import DeadlockWatch
from lightning_gpipe.engine.distributed import is_distributed

__all__ = [
    "PipelineError",
    "FailureBoard",
    "destroy_process_groups_at_exit",
    "exit_without_finalizers",
    "print_stacks_on_a_crash",
]

_KEY, _ACKS = "failed", "acks"
#: Where each process says, at its interpreter's exit, how its script ended (outside any run's namespace): a peer
#: whose collective it left waiting can then say so, instead of guessing at a crash (:meth:`FailureBoard.lost`).
_EXITED, _NO_ERROR = "lightning_gpipe/exited", "without an error"

#: This process's boards that published a failure on rank 0, the store's host: at its exit it keeps the store up until
#: the others know of it (:func:`_linger`). A process may fail several runs (one board each).
_PUBLISHED: list["FailureBoard"] = []


def _linger(seconds: float = 10.0) -> None:
    """At rank 0's exit: up to ``seconds`` in all for the other ranks to read every failure this process published."""
    deadline = time.monotonic() + seconds
    while _PUBLISHED:
        _PUBLISHED.pop().linger(max(0.0, deadline - time.monotonic()))


#: Seconds without a heartbeat after which :meth:`FailureBoard.lost` names a rank as the one gone.
SILENT = 1.0


class PipelineError(RuntimeError):
    """Another stage of the pipeline failed, or a stage could not be reached; the message names it."""


def _default_store() -> Optional[dist.Store]:
    # torch has no public accessor for the default group's store; this one helper is the only place
    # that reaches for the private one, so a torch upgrade breaks here and nowhere else.
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def _say_how_the_script_ended(store: dist.Store, rank: int) -> None:
    """At the interpreter's normal exit (not after a pipeline failure, which ends the process without it): write how
    this rank's script ended, for a peer that a collective of its own then finds cut off."""
    error = getattr(sys, "last_value", None)  # set by the interpreter for an exception that ended the script
    how = _NO_ERROR if error is None else f"with {type(error).__name__}: {error}"[:500]
    writer = threading.Thread(target=FailureBoard._quietly, args=(store.set, f"{_EXITED}/{rank}", how), daemon=True)
    writer.start()
    writer.join(timeout=1.0)  # a store whose host is gone must not hold the exit up


def exit_without_finalizers(
    board: Optional["FailureBoard"] = None, code: Optional[int] = None, error: Optional[BaseException] = None
) -> None:
    """At interpreter exit, end the process before the C++ finalizers run, with ``code`` or, by default, the status
    the interpreter would have given (:func:`_exit_status`).

    After a failed run, receiving threads may still be blocked on a dead or frozen peer; destroying
    their process groups at exit then aborts (SIGABRT) or blocks. Called once a run has failed. The rank that
    hosts the store first waits (briefly) until the others have read the failure from it. ``error``: the failure; a
    ``SystemExit`` (``sys.exit(3)`` in a step) gives its code, which the exit handlers could not see otherwise (the
    interpreter keeps no trace of the ``SystemExit`` that ends it; that rank exited 0).
    """
    if isinstance(error, SystemExit):
        _EXIT_CALLS.append(error.code)
    if getattr(exit_without_finalizers, "_registered", False):
        return
    exit_without_finalizers._registered = True  # type: ignore[attr-defined]
    _record_exit_calls()

    def _exit() -> None:
        if board is not None and board not in _PUBLISHED:
            _PUBLISHED.append(board)
        _linger()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status() if code is None else code)

    atexit.register(_exit)


#: The statuses given to ``sys.exit`` since a failure (see :func:`_record_exit_calls`).
_EXIT_CALLS: list[object] = []


def _record_exit_calls() -> None:
    """Note what ``sys.exit`` is called with from now on: at the exit handlers, nothing else tells a
    ``sys.exit(3)`` (or torch's spawn wrapper's ``sys.exit(1)`` after a worker's exception) from a script
    that ended normally."""

    def exit(status: object = None) -> NoReturn:  # noqa: A001  # sys.exit's own name, for tracebacks
        _EXIT_CALLS.append(status)
        raise SystemExit(status)  # what sys.exit does

    sys.exit = exit


def _exit_status() -> int:
    """The exit status the interpreter would give this process: 1 after an exception that ended it (under way in a
    ``finally`` that runs the exit handlers, as the tests' fork-server workers do, or one that ended the main
    module), a ``SystemExit``'s code, or 0 where the script ended normally: a script that caught the failure of a
    Trainer call and went on exits 0, as under DDP (it exited 1 with no message before)."""
    pending = sys.exc_info()[1] or getattr(sys, "last_value", None)
    if pending is None and _EXIT_CALLS:
        pending = SystemExit(_EXIT_CALLS[-1])
    if isinstance(pending, SystemExit):
        status = pending.code
        if status is None:
            return 0
        if isinstance(status, int):
            return status
        sys.stderr.write(f"{status}\n")  # as the interpreter prints a non-integer code
        return 1
    return 0 if pending is None else 1


def destroy_process_groups_at_exit() -> None:
    """At interpreter exit, shut every process group down while the interpreter is still whole.

    A gloo group left to the interpreter's teardown can abort a process that finished its work
    ("terminate called without an active exception", pytorch/pytorch#190489); seen here in about one
    run in ten of a job that builds pipelines several times. Lightning does not destroy its groups at
    the end of a run, so the strategy registers this once. After a failed run,
    :func:`exit_without_finalizers` (registered later, so run earlier) ends the process first.
    """
    if getattr(destroy_process_groups_at_exit, "_registered", False):
        return
    destroy_process_groups_at_exit._registered = True  # type: ignore[attr-defined]

    def _destroy() -> None:
        if is_distributed():
            try:
                dist.destroy_process_group()
            except Exception:  # exiting anyway: a group that cannot be shut down is left to the OS
                pass

    atexit.register(_destroy)


def print_stacks_on_a_crash() -> None:
    """Where a process dies in native code (an abort, a segmentation fault), print every thread's Python stack first.

    Such a rank cannot publish an error: its peers learn only that it is gone. The usual native death here is gloo's
    abort on a collective that the ranks called differently ("Received data size doesn't match expected size", from a
    ``self.log(..., sync_dist=True)`` on some ranks only): without a stack, the job's output held nothing of where.
    Python's own ``faulthandler`` does this; enabled here unless the user or pytest already did.
    """
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


class FailureBoard:
    """Publishes and watches the first failure of a job over the default process group's store.

    >>> board = FailureBoard(store=None, rank=0, world_size=1, describe=lambda r: f"stage {r}")  # a no-op
    >>> board.failure() is None
    True
    """

    def __init__(
        self,
        store: Optional[dist.Store],
        rank: int,
        world_size: int,
        describe: Callable[[int], str],
        namespace: str = "lightning_gpipe",
    ) -> None:
        self._store = dist.PrefixStore(namespace, store) if store is not None else None
        self.rank, self.world_size, self.describe = rank, world_size, describe
        self._published = False
        self._acknowledged = False  # this rank told the store's host that it knows of the failure (it read or made one)
        self._acknowledging = threading.Lock()  # the poller and the failure's writer both may
        self._message: Optional[str] = None  # another rank's failure, as the poller last saw it
        self._checks: list[Callable[[], Optional[str]]] = []
        self._deadlocks: Optional[DeadlockWatch] = None
        #: A failure of this rank that a background check found while its main thread was blocked elsewhere.
        self.found: Optional[PipelineError] = None
        #: Whether the main thread has this rank's failure in hand (it raised or reported it). Until then the watchdog
        #: ends the process ``grace`` s after a background check found it: a main thread stuck in the user's code (a
        #: sleep, an endless loop) never reaches a call that raises it, and under Lightning's default launcher
        #: nobody else ends it (the peers exit, and their parent does not watch itself).
        self._in_hand = False
        self._last_answer = time.monotonic()
        #: Per other rank: its heartbeat count as the poller last read it, and since when it has not changed.
        self._beats: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._base = store  # without this run's namespace: where every process says how its script ended

    @classmethod
    def for_default_group(cls, describe: Callable[[int], str], namespace: str) -> "FailureBoard":
        """A board on the default group's store; a no-op outside ``torch.distributed``."""
        if not is_distributed():
            return cls(None, 0, 1, describe, namespace)
        store, rank = _default_store(), dist.get_rank()
        if store is not None and not getattr(_say_how_the_script_ended, "registered", False):
            _say_how_the_script_ended.registered = True  # type: ignore[attr-defined]
            atexit.register(_say_how_the_script_ended, store, rank)  # after the groups' destroyer: runs before it
        return cls(store, rank, dist.get_world_size(), describe, namespace)

    # -- the training thread's side: no store access ------------------------------------------------------

    def publish(self, error: BaseException, in_hand: bool = True) -> None:
        """Tell the other ranks that this rank failed with ``error``; only the first failure is kept.

        ``in_hand``: the caller is the main thread, which goes on to raise or end the process; ``False`` for a
        failure a background check found (see :attr:`found`).
        """
        self._in_hand = self._in_hand or in_hand
        if self._store is None or self._published:
            return
        self._published = True
        verb = "reported" if isinstance(error, PipelineError) else "failed"  # a PipelineError names its cause
        text = str(error)
        name = "" if isinstance(error, PipelineError) else f"{type(error).__name__}" + (": " if text else "")
        notes = "".join(f" {note}" for note in getattr(error, "__notes__", []))  # where a stage's layer raised it
        message = f"{self.describe(self.rank)} (rank {self.rank}) {verb}: {name}{error}{notes}"
        writer = threading.Thread(target=self._set_failure, args=(message,), daemon=True)
        writer.start()
        writer.join(timeout=2.0)  # a dead store must not hold the failing rank up
        if self.rank == 0:
            # The store's host keeps it up at its exit until the others know of the failure: also after a failure
            # before the pipeline exists (the module's `setup`, `configure_model`), where the process exits without
            # exit_without_finalizers. Rank 0 exited, the store with it, and the others only learnt that stage 0 was
            # unreachable, not why.
            if not _PUBLISHED and not getattr(_linger, "registered", False):
                _linger.registered = True  # type: ignore[attr-defined]
                atexit.register(_linger)
            _PUBLISHED.append(self)

    def add_check(self, check: Callable[[], Optional[str]]) -> None:
        """Poll ``check`` with the store: a message it returns is published as this rank's failure.

        For failures that only a background thread can see, because the main thread is blocked in a
        call that will never return (a collective that the other ranks never join). The error is kept
        in :attr:`found`, for the main thread to raise once its call breaks.
        """
        self._checks.append(check)

    def watch_deadlocks(self, after: float) -> None:
        """Find ranks that have waited ``after`` s for each other (see :mod:`~lightning_gpipe.engine.deadlock`).

        Call it on the training thread: that is the thread whose waits count.
        """
        self._deadlocks = DeadlockWatch(self.rank, self.world_size, self.describe, after)

    def failure(self) -> Optional[str]:
        """Another rank's failure, if one is known."""
        return self._message

    def raise_if_failed(self) -> None:
        """Raise :class:`PipelineError` if another rank failed, or a background check found this rank's failure."""
        if self.found is not None:
            self._in_hand = True
            raise self.found
        if self._message is not None and not self._published:
            raise PipelineError(self._message)

    def wait_for_failure(self, seconds: float) -> Optional[str]:
        """The failure another rank published, waiting up to ``seconds`` for the poller to see it."""
        deadline = time.monotonic() + seconds
        while self._message is None and self._threads and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._message

    def lost(self, doing: str, error: BaseException) -> PipelineError:
        """The error for a collective that a peer's closed connection broke, with no failure published.

        A rank that was killed (by a signal, the out-of-memory killer, ``os._exit``, a crash in native
        code) cannot report; its heartbeat stops. The ranks whose heartbeat has not moved for a second
        are named: a live rank's poller beats four times a second. The heartbeat timeout would name the
        same rank, ``failure_timeout`` seconds later. A peer whose script had already ended (it said so at its exit,
        see :func:`_say_how_the_script_ended`) is named as such, with the usual cause: the ranks made different calls.
        """
        ended = self._scripts_ended()
        if ended:
            who = ", ".join(f"{self.describe(r)} (rank {r})" for r in ended)
            how = "; ".join(f"rank {r}: {ending}" for r, ending in ended.items())
            if any(ending != _NO_ERROR for ending in ended.values()):
                why = "see that rank's log for the error that ended it (an error outside a run is not reported here)"
            else:
                why = (
                    "so the ranks did not make the same calls: this rank waited for it in a call that every rank must "
                    "make. Common causes: a call under `if trainer.is_global_zero:` or `@rank_zero_only` that needs "
                    "every rank (`trainer.save_checkpoint`, whose barrier waits for all; a Trainer's fit, validate, "
                    "test or predict; a collective), or settings that end a run earlier on some ranks. Make such calls "
                    "on every rank (a checkpoint is still written by rank 0 alone), or keep one rank's own work free "
                    "of them (after a full-mode fit, `torch.save(trainer.lightning_module.state_dict(), path)` holds "
                    "the whole model)"
                )
            they = len(ended) > 1
            return PipelineError(
                f"Lost the connection to {who} during {doing}: {'they' if they else 'it'} had already ended "
                f"{'their scripts' if they else 'its script'} ({how}), {why}. "
                f"The transport said: {type(error).__name__}: {error}"
            )
        now = time.monotonic()
        gone = [r for r, (_, since) in sorted(self._beats.items()) if now - since > SILENT]
        who = ", ".join(f"{self.describe(r)} (rank {r})" for r in gone) or "another rank"
        return PipelineError(
            f"Lost the connection to {who} during {doing}: it ended without reporting an error (killed by a "
            "signal or the out-of-memory killer, os._exit, a crash in native code) or its network failed; see "
            f"its own log. The transport said: {type(error).__name__}: {error}"
        )

    def _scripts_ended(self) -> dict[int, str]:
        """The other ranks whose scripts have ended, each with how (see :func:`_say_how_the_script_ended`).

        Read on a helper thread that is given a second: the store's host may be gone, and its client would block.
        """
        base, found = self._base, {}
        if base is None:
            return {}

        def read() -> None:
            for rank in range(self.world_size):
                if rank != self.rank and base.check([f"{_EXITED}/{rank}"]):
                    found[rank] = base.get(f"{_EXITED}/{rank}").decode()

        reader = threading.Thread(target=self._quietly, args=(read,), daemon=True)
        reader.start()
        reader.join(timeout=1.0)
        return dict(found)

    # -- background threads --------------------------------------------------------------------------------

    def start(self, grace: float, failure_timeout: float, poll: float = 0.25) -> None:
        """Start polling the store (heartbeats, failures) and watching this process.

        A rank whose heartbeat stops for ``failure_timeout`` seconds is published as failed; a store
        that does not answer for that long counts as a failure of rank 0. ``grace`` seconds after a
        failure became known, a process still running is ended with exit code 1.
        """
        if self._store is None or self._threads:
            return
        self._stop.clear()
        self._last_answer = time.monotonic()
        self._threads = [
            threading.Thread(
                target=self._poll, args=(poll, failure_timeout), name="lightning-gpipe-poller", daemon=True
            ),
            threading.Thread(
                target=self._watch, args=(poll, grace, failure_timeout), name="lightning-gpipe-watchdog", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self._end_threads)

    def stop(self) -> None:
        """This rank's run ended normally: stop, and tell the others not to wait for its heartbeat."""
        atexit.unregister(self._end_threads)
        self._stop.set()
        if self._store is not None and self._threads:
            done = threading.Thread(target=self._quietly, args=(self._store.set, f"done/{self.rank}", "1"), daemon=True)
            done.start()
            done.join(timeout=2.0)
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._threads = []

    def _end_threads(self) -> None:
        """At the interpreter's exit, end the threads of a board that was never stopped.

        A board keeps watching after a failure (see the strategy's ``teardown``). A failure in setup,
        before the pipeline exists, ends the process normally: Python finalizes it, and the distributed
        runtime's C++ objects are destroyed while the daemon poller is still inside a store call. That
        aborted processes whose work was done ("terminate called without an active exception", exit
        code -6). Measured on the two-rank test sweep, whose last fit fails in setup on purpose: 8 of 50
        runs ended so before this, 0 of 16 after. The heartbeat, "done" and acknowledgement marks are left
        as they are.
        """
        self._stop.set()
        for thread in self._threads:  # the list stays: linger(), which may run after this, reads it
            thread.join(timeout=2.0)

    def linger(self, seconds: float = 10.0) -> None:
        """On the store's host, after a failure: give the others up to ``seconds`` to read it before exiting.

        Each other rank acknowledges once, when its poller reads the failure or when it publishes one of its own (a
        rank that failed too knows to end): where every rank failed alike, nobody waits. A rank whose heartbeat has
        not moved for twice :data:`SILENT` (killed, frozen: its poller beats four times a second) will never read it,
        and is not waited for: rank 0 lingered the whole ``seconds`` for a killed rank's acknowledgement before."""
        store = self._store
        if store is None or self.rank != 0 or not self._threads:
            return
        deadline = time.monotonic() + seconds
        start = time.monotonic()
        seen = {r: self._beats.get(r, (-1, start)) for r in range(1, self.world_size)}  # the poller's last reading
        while time.monotonic() < deadline:
            try:
                now = time.monotonic()
                for rank in list(seen):
                    if store.check([f"{_ACKS}/{rank}"]) or store.check([f"done/{rank}"]):
                        del seen[rank]
                        continue
                    beats = int(store.add(f"beat/{rank}", 0))
                    if beats != seen[rank][0]:
                        seen[rank] = (beats, now)
                if all(now - since > 2 * SILENT for _, since in seen.values()):
                    return
            except Exception:
                return
            time.sleep(0.05)

    @staticmethod
    def _quietly(call: Callable, *args: object) -> None:
        try:
            call(*args)
        except Exception:  # the store's host is gone; the poller reports that
            pass

    def _set_failure(self, message: str) -> None:
        try:
            if self._store is None:
                return
            self._store.compare_set(_KEY, "", message)
            self._acknowledge(self._store)
        except Exception:  # the store itself may be gone (its host died); nothing more can be said
            pass

    def _acknowledge(self, store: dist.Store) -> None:
        """Tell the store's host (rank 0, see :meth:`linger`) that this rank knows of a failure; once."""
        with self._acknowledging:
            if self.rank != 0 and not self._acknowledged:
                store.set(f"{_ACKS}/{self.rank}", "1")
                self._acknowledged = True

    def _poll(self, poll: float, failure_timeout: float) -> None:
        store = self._store
        assert store is not None
        last_seen = self._beats
        last_seen.update({r: (-1, time.monotonic()) for r in range(self.world_size) if r != self.rank})
        while not self._stop.wait(poll):
            self._run_checks()
            try:
                store.add(f"beat/{self.rank}", 1)
                self._check_heartbeats(last_seen, failure_timeout)
                self._check_deadlock(store)
                if store.check([_KEY]):
                    self._message = store.get(_KEY).decode()
                    self._acknowledge(store)
                self._last_answer = time.monotonic()
            except Exception as error:  # the store's host is gone; Lightning's launchers start it with rank 0
                if self._message is None:
                    self._message = (
                        f"{self.describe(0)} (rank 0) is unreachable: the job's store, which rank 0 "
                        f"hosts, failed ({type(error).__name__}: {error})"
                    )
                return

    def _run_checks(self) -> None:
        if self._published or self._message is not None:
            return
        for check in self._checks:
            message = check()
            if message is not None:
                self.found = PipelineError(message)
                self.publish(self.found, in_hand=False)
                return

    def _check_deadlock(self, store: dist.Store) -> None:
        if self._deadlocks is None or self._published or self._message is not None:
            return
        message = self._deadlocks.poll(store)
        if message is not None:
            self.found = PipelineError(message)
            self.publish(self.found, in_hand=False)

    def _check_heartbeats(self, last_seen: dict, failure_timeout: float) -> None:
        store = self._store
        assert store is not None
        now = time.monotonic()
        for rank, (beats, since) in list(last_seen.items()):
            if store.check([f"done/{rank}"]):
                del last_seen[rank]
                continue
            current = int(store.add(f"beat/{rank}", 0))
            if current != beats:
                last_seen[rank] = (current, now)
            elif now - since > failure_timeout and current == 0:  # it never beat in this run
                self._set_failure(
                    f"{self.describe(rank)} (rank {rank}) stopped responding or has not joined this run: no heartbeat "
                    f"in the {now - since:.0f}s since it began. It was killed, is frozen, or is still in code before "
                    "this run (waiting in a collective that only some ranks called, such as `trainer.log_dir`, "
                    "`strategy.broadcast` or `barrier` under `if trainer.is_global_zero:` or in a @rank_zero_only "
                    "function: call it on every rank)"
                )
                del last_seen[rank]
            elif now - since > failure_timeout:
                self._set_failure(
                    f"{self.describe(rank)} (rank {rank}) stopped responding: no heartbeat for "
                    f"{now - since:.0f}s (killed, or frozen)"
                )
                del last_seen[rank]

    def _watch(self, poll: float, grace: float, failure_timeout: float) -> None:
        while not self._stop.wait(poll):
            silent = time.monotonic() - self._last_answer
            if self._message is None and silent > failure_timeout:
                self._message = (
                    f"{self.describe(0)} (rank 0) stopped responding: the job's store, which rank 0 "
                    f"hosts, has not answered for {silent:.0f}s (rank 0 is gone, or this rank waits to form a "
                    "process group or join a collective that rank 0 has not reached, which holds the store: a "
                    "collective only some ranks called, such as `trainer.log_dir` read on rank 0 alone)"
                )
            stuck = self.found is not None and not self._in_hand  # this rank's own failure, found in the background
            if not stuck and (self._message is None or self._published):
                continue
            if self._stop.wait(grace) or self._in_hand or (not stuck and self._published):
                return
            if stuck:
                why = (
                    f"{grace:.0f}s after a check found this rank's failure while its main thread stayed busy "
                    f"outside the pipeline (its stack is below: code that hangs or runs longer than the failure "
                    f"timeout, or a collective the other ranks never joined).\n{self.found}\n"
                )
            else:
                why = f"{grace:.0f}s after another rank failed and this one stayed blocked.\n{self._message}\n"
            sys.stderr.write(f"[lightning_gpipe] rank {self.rank}: ending this process, {why}")
            main = threading.main_thread().ident
            traceback.print_stack(sys._current_frames().get(main) if main is not None else None, file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)
