"""A rank that fails ends every rank of the job, quickly and with an error that names the failed stage."""

from __future__ import annotations

import subprocess
import sys

import _sweeps
import pytest

from lightning_gpipe.launch import run_processes


@pytest.mark.parametrize(
    "stages, failing, in_setup",
    [(2, 1, False), (3, 0, False), (3, 1, False), (3, 2, False), (2, 0, True)],
    ids=["2 stages, stage 1", "3 stages, stage 0", "3 stages, stage 1", "3 stages, stage 2", "stage 0 in setup"],
)
def test_an_exception_in_one_stage_ends_every_rank_within_seconds(stages, failing, in_setup):
    # in setup, before the pipeline exists: rank 0, the store's host, exited before the others had read its failure,
    # and they said only "stage 0 (rank 0) is unreachable: the job's store ... failed"
    outcome = run_processes(_sweeps.failing_fit, stages, failing, in_setup, timeout=120)
    assert all(code is not None for code in outcome.exitcodes), f"hung ranks: {outcome.exitcodes}"
    assert all(code != 0 for code in outcome.exitcodes), outcome.exitcodes
    assert outcome.seconds < 60  # process start-up included; the failure itself propagates in about a second
    assert f"boom on rank {failing}" in outcome.errors[failing]
    for rank in range(stages):
        if rank != failing:
            assert outcome.errors[rank].startswith("PipelineError"), outcome.errors[rank]
            assert (
                f"stage {failing} (rank {failing}) failed: RuntimeError: boom on rank {failing}" in outcome.errors[rank]
            )
            if not in_setup:  # which layer raised it, on which micro-batch: the error's note reaches every rank
                assert f"(Boom) on stage {failing} on micro-batch" in outcome.errors[rank], outcome.errors[rank]


def test_a_rank_killed_outside_the_pipeline_ends_the_others_naming_its_stage_before_the_heartbeat_timeout():
    # a rank that dies without an exception (a signal, the out-of-memory killer, os._exit) breaks the collective
    # its peers wait in; they named gloo's "Connection reset by peer" alone, with no word of which rank was gone
    outcome = run_processes(_sweeps.dying_fit, 2, 1, timeout=120, wait_for=[0])
    assert outcome.exitcodes == [1, 3], (outcome.exitcodes, outcome.errors)
    error = outcome.errors[0] or ""
    assert error.startswith("PipelineError: Lost the connection to stage 1 (rank 1) during a decision of every rank")
    # gloo words the broken connection in more than one way ("Connection reset by peer", "... a remote worker
    # crashing"); the error keeps whichever it was, after the stage it names
    assert "ended without reporting an error" in error and "The transport said: " in error
    ended = outcome.ended[0]
    assert ended is not None and ended < 45  # start-up included; the heartbeat timeout is 60 s


_UNSTOPPED_BOARD = """
import atexit, threading, torch.distributed as dist
from lightning_gpipe.engine.failure import FailureBoard

def report():  # registered first, so it runs after the board's own exit handler
    alive = [t.name for t in threading.enumerate() if t.name.startswith("lightning-gpipe")]
    print("alive at exit:", alive, flush=True)

atexit.register(report)
board = FailureBoard(dist.HashStore(), 0, 2, lambda r: f"stage {r}")
board.start(grace=10.0, failure_timeout=30.0, poll=0.01)
print("running:", sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning-gpipe")), flush=True)
# never stopped, as after a failure in setup: the interpreter's exit must end its threads
"""


def test_a_board_never_stopped_ends_its_threads_before_the_interpreter_tears_down():
    done = subprocess.run([sys.executable, "-c", _UNSTOPPED_BOARD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "running: ['lightning-gpipe-poller', 'lightning-gpipe-watchdog']" in done.stdout
    assert "alive at exit: []" in done.stdout, done.stdout
