"""The launcher of the tests and benchmarks: workers forked from a fork server behave as fresh processes."""

from __future__ import annotations

import atexit
import os

from lightning_gpipe.launch import run_ok, run_processes


def _environment(rank: int, world_size: int, name: str) -> tuple[str | None, str]:
    return os.environ.get(name), os.environ["RANK"]


def test_workers_see_the_callers_environment_at_the_call_not_the_fork_servers_at_its_start(monkeypatch):
    run_ok(_environment, 1, "LIGHTNING_GPIPE_LAUNCH_TEST")  # the fork server is up from here on
    monkeypatch.setenv("LIGHTNING_GPIPE_LAUNCH_TEST", "set after the server started")
    assert run_ok(_environment, 2, "LIGHTNING_GPIPE_LAUNCH_TEST") == [
        ("set after the server started", "0"),
        ("set after the server started", "1"),
    ]
    monkeypatch.delenv("LIGHTNING_GPIPE_LAUNCH_TEST")
    assert run_ok(_environment, 1, "LIGHTNING_GPIPE_LAUNCH_TEST") == [(None, "0")]


def _register_exit_handler(rank: int, world_size: int, directory: str, fail: bool) -> None:
    def write() -> None:
        with open(os.path.join(directory, f"exited-{rank}"), "w") as f:
            f.write("ran")

    atexit.register(write)
    if fail:
        raise RuntimeError(f"rank {rank} fails")


def test_a_workers_exit_handlers_run_at_its_end_as_at_a_spawned_interpreters_exit(tmp_path):
    # the package relies on them: after a failure, the store's host waits there until every rank read it
    for fail in (False, True):
        directory = tmp_path / str(fail)
        directory.mkdir()
        outcome = run_processes(_register_exit_handler, 2, str(directory), fail, timeout=60)
        assert outcome.exitcodes == ([1, 1] if fail else [0, 0]), outcome.errors
        assert sorted(os.listdir(directory)) == ["exited-0", "exited-1"]
