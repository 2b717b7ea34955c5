"""Run a function in K real processes, as torchrun would start them, and collect what each returns.

Each worker gets the environment of a torchrun launch (RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID...), so
Lightning uses its TorchElastic cluster environment and does not launch processes of its own: one
spawn of K processes can run many ``Trainer.fit`` calls, which keeps the tests fast (``import torch``
costs seconds per process). Workers start from a fork server that has imported torch and this package
once (``forkserver``; ``spawn`` where the platform has no fork server), so a run of K processes starts in
a fraction of a second instead of K fresh interpreter imports. Results travel as ``torch.save`` files.
The tests, the benchmarks and plain-PyTorch users of the engine (``GPipe`` needs one process per stage)
share this launcher; for jobs, use torchrun or Lightning's own launchers.

Example::

    def work(rank, world_size):
        dist.init_process_group("gloo")          # reads the torchrun environment set here
        pipe = GPipe(nn.Sequential(...), chunks=4)
        return pipe(x).sum().item()

    results = run_ok(work, 2)                    # one result per rank
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gpipe.engine.distributed import is_distributed

__all__ = ["Outcome", "WorkerFailed", "free_port", "run_ok", "run_processes"]


def free_port() -> int:
    """A TCP port on the loopback that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the fork server imports once, before it forks any worker: the heavy imports every worker makes
#: (``import lightning_gpipe`` imports Lightning too). ``__main__`` first, as multiprocessing's default has it.
PRELOAD = ["__main__", "torch", "torch.distributed", "lightning_gpipe"]


def _start_method() -> str:
    """``forkserver`` where the platform has one, else ``spawn``: never plain ``fork``, which would copy the
    caller's threads' state (a gloo group, OpenMP pools) into the workers."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.set_forkserver_preload(PRELOAD)  # read when the server starts (first use), later calls change nothing
    return "forkserver"


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    out_dir: str,
    threads: int,
    environment: dict[str, str],
    forked: bool,
) -> None:
    # the environment of the caller at this call, not of the fork server at its start (a test may set a
    # variable between two runs)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID="lightning-gpipe-tests",
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        try:
            result = fn(rank, world_size, *args)
        except BaseException as error:
            torch.save({"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}, path)
            raise
        torch.save({"result": result}, path)
        if is_distributed():  # before the interpreter's teardown, which gloo can abort in
            dist.destroy_process_group()
    finally:
        if forked:
            # A worker forked from the fork server ends with os._exit, which skips the interpreter's exit
            # handlers. A torchrun or Lightning process runs them, and the package relies on it: after a
            # failure, the store's host waits there until the other ranks have read the failure. So run them
            # here, as a spawned interpreter would at its exit.
            atexit._run_exitfuncs()


@dataclass
class Outcome:
    """How each rank ended: its exit code, its result or error, and when it exited."""

    exitcodes: list[int | None]
    results: list[Any]
    errors: list[str | None]
    tracebacks: list[str | None]
    seconds: float
    ended: list[float | None]  # seconds from the start until each rank exited (None: killed at the timeout)


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    threads: int = 1,
    wait_for: list[int] | None = None,
) -> Outcome:
    """Start ``fn(rank, world_size, *args)`` in ``world_size`` new processes; wait up to ``timeout`` s.

    Nothing is killed early when one rank fails, so a test can see whether the others end by
    themselves. Ranks still alive at the timeout (or, with ``wait_for``, once those ranks have all
    exited) are killed and reported with exit code ``None``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        start = time.monotonic()
        method = _start_method()
        context = mp.start_processes(
            _worker,
            args=(world_size, port, fn, args, out_dir, threads, dict(os.environ), method == "forkserver"),
            nprocs=world_size,
            start_method=method,
            join=False,
        )
        deadline = start + timeout
        ended: list[float | None] = [None] * world_size
        watched = [context.processes[r] for r in (wait_for if wait_for is not None else range(world_size))]
        while any(p.is_alive() for p in watched) and time.monotonic() < deadline:
            for rank, p in enumerate(context.processes):
                if ended[rank] is None and not p.is_alive():
                    ended[rank] = time.monotonic() - start
            time.sleep(0.05)
        for rank, p in enumerate(context.processes):
            if ended[rank] is None and not p.is_alive():
                ended[rank] = time.monotonic() - start
        hung = [p for p in context.processes if p.is_alive()]
        for p in hung:
            p.kill()
        for p in context.processes:
            p.join(5)
        seconds = time.monotonic() - start
        exitcodes = [None if p in hung else p.exitcode for p in context.processes]
        results, errors, tracebacks = [], [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            data = torch.load(path, weights_only=False) if os.path.exists(path) else {}
            results.append(data.get("result"))
            errors.append(data.get("error"))
            tracebacks.append(data.get("traceback"))
        return Outcome(exitcodes, results, errors, tracebacks, seconds, ended)


class WorkerFailed(RuntimeError):
    """A rank of :func:`run_ok` failed; the message holds every rank's exit code and traceback."""


def run_ok(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, threads: int = 1) -> list[Any]:
    """Like :func:`run_processes`, but every rank must succeed (else :class:`WorkerFailed`); the per-rank results."""
    outcome = run_processes(fn, world_size, *args, timeout=timeout, threads=threads)
    if any(code != 0 for code in outcome.exitcodes):
        details = "\n".join(
            f"--- rank {r} (exit {c}) ---\n{t or e or 'no error recorded'}"
            for r, (c, e, t) in enumerate(zip(outcome.exitcodes, outcome.errors, outcome.tracebacks))
        )
        raise WorkerFailed(f"a worker failed after {outcome.seconds:.1f}s:\n{details}")
    return outcome.results
