"""What two stages on one machine cost each other: each kind of work alone, and in two processes at once.

    python benchmarks/corun.py                    # CPU, here: about 1 minute

A pipeline's stages compute at the same time. Where they share a machine (the CPU's cores, here), each
may run slower than it did alone, which neither a one-process profile (the planner's) nor the ideal
speed-up K*M/(M+K-1) sees. This measures that slowdown per kind of work, one thread per process:

- ``matmul``: 512x512 matrix products (compute-bound);
- ``conv``: a 3x3 convolution, 64 channels, 8 images of 32x32 (compute-bound, oneDNN);
- ``small ops``: a 16-wide linear layer and a ReLU (bound by the per-op dispatch in Python and C++);
- ``stream``: ``y = 2 * x`` over 64 MiB (bound by memory bandwidth);
- ``amoebanet`` and ``transformer``: a forward and backward of a micro-batch of 4 through the benchmark
  models of ``_common.py`` (the work a stage does);
- ``amoebanet, 8 held`` and ``transformer, 8 held``: the forwards of 8 such micro-batches, each holding its
  activations, then their backwards: a stage's step under ``checkpoint="never"``, with its working set.

Rank 0 runs each kind for ``--seconds`` alone (rank 1 idles at a barrier), then both ranks run it at once;
``--rounds`` rounds, the kinds taking turns. The slowdown is the median of each round's alone over together
(rank 0's rate; together, the mean of both ranks'). Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import _common as C
import torch
import torch.distributed as dist
from torch import nn

KINDS = (
    "matmul",
    "conv",
    "small ops",
    "stream",
    "amoebanet",
    "transformer",
    "amoebanet, 8 held",
    "transformer, 8 held",
)


def _work(kind: str, args: argparse.Namespace) -> Callable[[], None]:
    """One unit of ``kind``: a callable that does it once."""
    torch.manual_seed(0)
    if kind == "matmul":
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        return lambda: torch.mm(a, b, out=torch.empty(512, 512))
    if kind == "conv":
        conv, x = nn.Conv2d(64, 64, 3, padding=1), torch.randn(8, 64, 32, 32)

        def convolve() -> None:
            with torch.no_grad():
                conv(x)

        return convolve
    if kind == "small ops":
        linear, x = nn.Linear(16, 16), torch.randn(16, 16)

        def small() -> None:
            with torch.no_grad():
                linear(x).relu_()

        return small
    if kind == "stream":
        x = torch.randn(args.stream_mib * 2**20 // 4)
        y = torch.empty_like(x)
        return lambda: torch.mul(x, 2.0, out=y)
    name, _, held = kind.partition(", ")
    workload = C.workloads([name], args)[0]
    model = workload.build()
    batches = [workload.batch(args.micro_batch, torch.device("cpu")) for _ in range(8 if held else 1)]

    def step() -> None:
        losses = [workload.loss(model(inputs), targets) for inputs, targets in batches]  # every graph held
        for loss in losses:
            loss.backward()

    return step


def _rate(work: Callable[[], None], seconds: float) -> float:
    """Calls of ``work`` per second over ``seconds`` (at least one call)."""
    calls, start = 0, time.perf_counter()
    while True:
        work()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls / elapsed


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    C.init_group(torch.device("cpu"))
    works = {kind: _work(kind, args) for kind in args.kinds}
    for work in works.values():  # warm up: kernels, allocator
        _rate(work, min(args.seconds, 0.2))
    rounds: dict[str, list[tuple[float, float]]] = {kind: [] for kind in args.kinds}
    for _ in range(args.rounds):
        for kind, work in works.items():
            dist.barrier()
            alone = _rate(work, args.seconds) if rank == 0 else 0.0
            dist.barrier()
            together = _rate(work, args.seconds)
            both = torch.tensor([together])
            dist.all_reduce(both)
            rounds[kind].append((alone, float(both) / world))
    dist.destroy_process_group()
    rows = []
    for kind, pairs in rounds.items():
        slowdowns = [alone / together for alone, together in pairs]
        rows.append(
            {
                "kind": kind,
                "alone_per_s": statistics.median(a for a, _ in pairs),
                "together_per_s": statistics.median(t for _, t in pairs),
                "slowdown": statistics.median(slowdowns),
                "slowdown_min": min(slowdowns),
                "slowdown_max": max(slowdowns),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_workload_arguments(parser)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--seconds", type=float, default=2.0, help="per kind, alone and together, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per forward and backward of a model")
    parser.add_argument("--stream-mib", type=int, default=64, help="the size of the stream's tensor")
    parser.add_argument("--out", default=C.default_out("corun"))
    args = parser.parse_args()

    rows = C.launch(worker, 2, args)[0]
    info = C.machine("cpu")
    print(
        f"\nEach kind of work alone and in two processes at once, one thread each; medians of {args.rounds} rounds "
        f"of {args.seconds:g} s\n{C.describe_machine(info)}\n"
    )
    print(
        C.markdown(
            ["work", "alone per s", "together per s (each)", "slowdown (min-max)"],
            [
                [
                    r["kind"],
                    f"{r['alone_per_s']:.1f}",
                    f"{r['together_per_s']:.1f}",
                    f"{r['slowdown']:.2f}x ({r['slowdown_min']:.2f}-{r['slowdown_max']:.2f})",
                ]
                for r in rows
            ],
        )
    )
    C.write_json(args.out, {"machine": info, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
