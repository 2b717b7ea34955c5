"""Ranks that wait for each other for good, found within seconds: a deadlock named instead of a hang.

Code that runs on some ranks only can leave two ranks each waiting for the other. A ``@rank_zero_only``
callback that calls ``trainer.save_checkpoint`` puts rank 0 in the gather of every stage's state while
rank 1 has gone on to the next batch, where it waits for rank 0's activations, or inside one of
Lightning's own collectives (its loop broadcasts from rank 0 before every training batch). Neither
wait ends before the process group's timeout (30 minutes by default), and no message arrives that
the stray-message check could see.

So the training thread says what it waits for (:func:`blocked`): a message from one rank, or a
collective over a group. A wait in a ``torch.distributed`` call that is not this package's (Lightning's,
the user's) is read from the thread's stack instead. The failure board's poller publishes a wait
that has lasted ``after`` seconds to the job's store, reads the other ranks' and looks for a cycle:
every rank in it has waited that long for the next one, so none of them can move. Ranks in the same
collective (the same operation over the same group, for the same purpose) do not wait for each other. A rank that is
running, or blocked in anything else, publishes nothing and ends every cycle, so a slow rank is
never taken for a deadlocked one.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch.distributed as dist

__all__ = ["Blocked", "DeadlockWatch", "blocked", "find_cycle", "collective_wait"]


@dataclass(frozen=True)
class Blocked:
    """What a rank waits for: ``what`` in words, the global ranks ``on`` whose move would end it, and, for a
    collective, ``collective``: equal on every rank that is in the same one (its operation and group)."""

    what: str
    on: tuple[int, ...]
    collective: str = ""
    since: float = 0.0  # wall-clock seconds, so that other ranks can tell how long

    def encode(self) -> str:
        return json.dumps([self.what, list(self.on), self.collective, self.since])

    @staticmethod
    def decode(text: str) -> "Blocked":
        what, on, collective, since = json.loads(text)
        return Blocked(what, tuple(on), collective, since)


#: What each thread is blocked in, as it said (:class:`blocked`); written by that thread, read by the poller.
_waits: dict[int, tuple[Union[str, Callable[[], str]], tuple[int, ...], str, float]] = {}


class blocked:
    """Say that this thread waits, inside the ``with`` block, for ``on`` (see :class:`Blocked`).

    ``what`` may be a function that says it, called only if the wait is published: a stage enters one
    of these for every message it receives, so the cost of an unpublished wait is kept to a dict entry.
    """

    __slots__ = ("_entry", "_ident", "_previous")

    def __init__(self, what: Union[str, Callable[[], str]], on: tuple[int, ...], collective: str = "") -> None:
        self._entry = (what, on, collective)

    def __enter__(self) -> None:
        self._ident = threading.get_ident()
        self._previous = _waits.get(self._ident)
        _waits[self._ident] = (*self._entry, time.time())

    def __exit__(self, *exc: object) -> None:
        if self._previous is None:
            _waits.pop(self._ident, None)
        else:
            _waits[self._ident] = self._previous


def _ranks(group: Optional[dist.ProcessGroup]) -> tuple[int, ...]:
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def collective_wait(operation: str, group: Optional[dist.ProcessGroup], doing: str) -> tuple[str, tuple[int, ...], str]:
    """The arguments of :func:`blocked` for ``operation`` (``"all_reduce"``, say) over ``group``, done for ``doing``."""
    ranks = _ranks(group)
    me = dist.get_rank()
    # The purpose is part of the collective's identity: two ranks in an all_gather over the same group, one to
    # gather the stages' state and one to decide whether to stop, are in different calls that wait for each other.
    same = f"{operation} {ranks} for {doing}"
    return f"{doing} ({operation} over ranks {list(ranks)})", tuple(r for r in ranks if r != me), same


def _foreign(frame: Any) -> Optional[tuple[Any, str, tuple[int, ...], str]]:
    """If ``frame`` (a thread's innermost) is inside a ``torch.distributed`` call: the call's frame, and
    :func:`blocked`'s arguments for it."""
    call = None
    while frame is not None and "torch/distributed/" in frame.f_code.co_filename.replace("\\", "/"):
        if frame.f_code.co_filename.endswith("distributed_c10d.py"):
            call = frame
        frame = frame.f_back
    if call is None or not dist.is_initialized():
        return None
    group = call.f_locals.get("group")
    try:
        ranks = _ranks(group if isinstance(group, dist.ProcessGroup) else None)
    except (RuntimeError, ValueError):
        return None
    where = ""
    if frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        path = path.split("site-packages/")[-1]
        where = f", called from {path}:{frame.f_lineno} ({frame.f_code.co_name})"
    operation = call.f_code.co_name
    me = dist.get_rank()
    what = f"torch.distributed.{operation} over ranks {list(ranks)}{where}"
    return call, what, tuple(r for r in ranks if r != me), f"{operation} {ranks}"


def find_cycle(waits: dict[int, Blocked], start: int) -> Optional[list[int]]:
    """Ranks that wait for each other in a ring through ``start``, in order, if there is such a ring.

    ``waits`` holds the ranks known to be blocked. A rank waits for another when it waits for a message
    from it, or when it is in a collective that the other has not joined (the other is blocked elsewhere).

    >>> gather = Blocked("a gather", (1,), "all_gather (0, 1)")
    >>> find_cycle({0: gather, 1: Blocked("a message from rank 0", (0,))}, 0)
    [0, 1]
    >>> find_cycle({0: gather, 1: Blocked("the same gather", (0,), "all_gather (0, 1)")}, 0) is None
    True
    """

    def waits_for(rank: int) -> list[int]:
        wait = waits[rank]
        return [r for r in wait.on if r in waits and not (wait.collective and waits[r].collective == wait.collective)]

    path, seen = [start], {start}

    def walk(rank: int) -> bool:
        for other in waits_for(rank):
            if other == start:
                return True
            if other not in seen:
                seen.add(other)
                path.append(other)
                if walk(other):
                    return True
                path.pop()
        return False

    return path if walk(start) else None


class DeadlockWatch:
    """Run by the failure board's poller: publishes this rank's long wait and finds a ring of them.

    ``thread`` is the training thread (the one that built the board); ``after`` the seconds a wait must
    last before it counts.
    """

    def __init__(self, rank: int, world_size: int, describe: Callable[[int], str], after: float) -> None:
        self.rank, self.world_size, self.describe, self.after = rank, world_size, describe, after
        self.thread = threading.get_ident()
        self._written = ""
        self._foreign: Optional[tuple[Any, Blocked]] = None  # the torch.distributed call's frame, and its wait

    def _current(self) -> Optional[Blocked]:
        said = _waits.get(self.thread)
        if said is not None:
            self._foreign = None
            what, on, collective, since = said
            return Blocked(what() if callable(what) else what, on, collective, since)
        found = _foreign(sys._current_frames().get(self.thread))
        if found is None:
            self._foreign = None
            return None
        frame, what, on, collective = found
        if self._foreign is None or self._foreign[0] is not frame:  # a new call: its wait starts now
            self._foreign = (frame, Blocked(what, on, collective, time.time()))
        return self._foreign[1]

    def poll(self, store: dist.Store) -> Optional[str]:
        """Publish this rank's wait once it has lasted ``after`` s; the deadlock's description, if there is one."""
        now = time.time()
        mine = self._current()
        record = mine.encode() if mine is not None and now - mine.since >= self.after else ""
        if record != self._written:
            store.set(f"blocked/{self.rank}", record)
            self._written = record
        if mine is None or not record:
            return None
        waits = {self.rank: mine}
        for rank in range(self.world_size):
            key = f"blocked/{rank}"
            if rank != self.rank and store.check([key]):
                text = store.get(key).decode()
                try:
                    waits[rank] = Blocked.decode(text)
                except ValueError:  # "" (a wait that ended), or a record this version cannot read: no wait known
                    continue
        cycle = find_cycle(waits, self.rank)
        if cycle is None:
            return None
        each = "; ".join(
            f"{self.describe(r)} (rank {r}) has waited {max(now - waits[r].since, 0.0):.0f}s for {waits[r].what}"
            for r in cycle
        )
        return (
            f"The pipeline's ranks are waiting for each other, and none can go on (a deadlock): {each}. Usual "
            "causes: code that runs on some ranks only (a callback under @rank_zero_only, or under `if "
            "trainer.is_global_zero:`) and calls what every rank must call: `trainer.save_checkpoint`, the "
            "model, `self.all_gather`, `self.log(..., sync_dist=True)`, `trainer.strategy.barrier()`, gradient "
            "clipping by norm (`clip_grad_norm_`: the norm is every stage's); or that sets "
            "`trainer.should_stop` in the LightningModule's own hooks on some ranks only (callbacks' stops are "
            "agreed over the ranks). Call those on every rank (Lightning writes files and logs on rank 0 only); "
            "keep only the rest under rank zero. Or the ranks' training data ran out at different batches (an "
            "`IterableDataset` that yields another number of samples in each process, or shards itself by "
            "`get_worker_info`/rank across the stages): every stage of a pipeline must get the same batches."
        )
