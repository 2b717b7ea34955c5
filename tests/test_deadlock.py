"""Ranks that wait for each other are found from what each says it waits for, and slow ranks are not.

Each "rank" here is a thread blocked in :class:`~lightning_gpipe.engine.deadlock.blocked`, with its own
watch, over one real key-value store (``torch.distributed.HashStore``); the multi-process cases, with
Lightning's own collectives, are in ``tests/test_trust.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist

from lightning_gpipe.engine.deadlock import DeadlockWatch, blocked

AFTER = 0.05


@contextmanager
def rank_waiting(rank: int, what: Optional[tuple[str, tuple[int, ...], str]]) -> Iterator[DeadlockWatch]:
    """A thread for ``rank``, blocked in ``what`` (or running, if None) until the block ends; its watch."""
    ready, release = threading.Event(), threading.Event()
    watches: list[DeadlockWatch] = []

    def run() -> None:
        watches.append(DeadlockWatch(rank, 2, lambda r: f"stage {r}", AFTER))
        if what is None:
            ready.set()
            release.wait()
            return
        with blocked(*what):
            ready.set()
            release.wait()

    thread = threading.Thread(target=run)
    thread.start()
    ready.wait()
    try:
        yield watches[0]
    finally:
        release.set()
        thread.join()


GATHER = ("a gather of every stage's state", (1,), "all_gather (0, 1)")
MESSAGE = ("the forward of micro-batch 0 from stage 0 (rank 0)", (0,), "")


def test_a_gather_and_a_wait_for_its_own_ranks_message_are_a_deadlock_that_names_both_waits():
    store = dist.HashStore()
    with rank_waiting(0, GATHER) as zero, rank_waiting(1, MESSAGE) as one:
        assert zero.poll(store) is None and one.poll(store) is None  # not waited long enough yet
        assert not store.check(["blocked/0"]) and not store.check(["blocked/1"])  # nor published
        time.sleep(AFTER * 2)
        assert one.poll(store) is None  # rank 0's wait is not published yet: no cycle is known
        found = zero.poll(store)
    assert found is not None and found.startswith("The pipeline's ranks are waiting for each other")
    assert "stage 0 (rank 0) has waited 0s for a gather of every stage's state" in found
    assert "stage 1 (rank 1) has waited 0s for the forward of micro-batch 0 from stage 0 (rank 0)" in found


def test_ranks_in_the_same_collective_or_a_running_rank_are_no_deadlock():
    store = dist.HashStore()
    with rank_waiting(0, GATHER) as zero, rank_waiting(1, ("the same gather", (0,), "all_gather (0, 1)")) as one:
        time.sleep(AFTER * 2)
        assert one.poll(store) is None and zero.poll(store) is None
    store = dist.HashStore()
    with rank_waiting(0, GATHER) as zero, rank_waiting(1, None) as one:  # rank 1 computes, however long
        time.sleep(AFTER * 2)
        assert one.poll(store) is None and zero.poll(store) is None
        assert store.get("blocked/0") and not store.check(["blocked/1"])  # only a long wait is published


def test_a_wait_that_ended_is_taken_back_from_the_store():
    store = dist.HashStore()
    with rank_waiting(0, GATHER) as zero:
        time.sleep(AFTER * 2)
        zero.poll(store)
        assert b"a gather of every stage's state" in store.get("blocked/0")
    zero.poll(store)  # the thread has left its wait
    assert store.get("blocked/0") == b""
