"""Peers: the same model, K and M under this package and under the alternatives a user would weigh, in one run.

    python benchmarks/peers.py                                # K=2, M=8 on CPU here
    python benchmarks/peers.py --stages 4 --chunks 16 --models transformer

Rows, all on the same batch with an SGD step:

- ``gpipe`` engine (``GPipe``, no Lightning) with ``checkpoint="never"`` (like for like with
  ``torch.distributed.pipelining``, which does not re-materialize), the same with
  ``split_backward=True`` (input gradients first in the drain), and with the default
  ``"except_last"``; and ``Trainer(strategy=GPipeStrategy(...))``;
- ``torch.distributed.pipelining`` ``ScheduleGPipe`` and ``Schedule1F1B``, on the same split;
- one process holding the whole model, with 1 thread and with K threads (no micro-batching);
- Lightning's DDP with K processes, each on batch/K samples.

Every variant runs under the same glibc malloc settings (``--malloc``): ``keep`` (the default) sets the
thresholds that ``GPipeStrategy(reuse_freed_memory=True)``, the strategy's default, sets in a stage
process, for every variant alike; ``glibc`` leaves glibc's own. (Before this option, the Trainer row set
them for the rest of its process, so the variants after it in a round ran with them and those before it
without: the order alternates by round, which favoured the engine in one round and the peers in the next.)

Pipelines run one process per stage with one thread each. The variants run in one set of processes
per layout, in alternating order over ``--rounds`` rounds. The table gives each variant's median step
over the rounds, and its throughput against the engine's (``never``) as the median of the per-round
ratios with their spread (min-max): a ratio within one round compares runs that shared the machine's
state. Prints a markdown table per model and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import _common as C
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_gpipe.engine.host_malloc import MMAP_THRESHOLD, TRIM_THRESHOLD, set_thresholds


class Unpacked(nn.Module):
    """A stage for ``torch.distributed.pipelining``, which calls a stage with a tuple input unpacked."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, *args: torch.Tensor) -> Any:
        return self.layers(args[0] if len(args) == 1 else args)


def pipelining_step(
    workload: C.Workload,
    schedule: str,
    stages: int,
    chunks: int,
    batch_size: int,
    device: torch.device,
    split: list[int],
) -> Callable[[], None]:
    """One training step of the same split under ``torch.distributed.pipelining``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    rank = dist.get_rank()
    start = sum(split[:rank])
    module = Unpacked(nn.Sequential(*list(workload.build())[start : start + split[rank]])).to(device)
    stage = PipelineStage(module, rank, stages, device)
    runner = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}[schedule](
        stage, n_microbatches=chunks, loss_fn=F.cross_entropy
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    x, y = workload.batch(batch_size, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            runner.step(x)
        elif rank == stages - 1:
            runner.step(target=y, losses=[])
        else:
            runner.step()
        optimizer.step()

    return step


def single_step(workload: C.Workload, batch_size: int, device: torch.device) -> Callable[[], None]:
    """One training step of the whole model in one process: no pipeline, no micro-batches."""
    torch.manual_seed(0)
    model = workload.build().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = workload.batch(batch_size, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def set_malloc(args: argparse.Namespace) -> None:
    """``--malloc keep``: this process's malloc thresholds as a gpipe stage's, for every variant alike."""
    if args.malloc == "keep":
        refused = set_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)
        if refused:
            raise SystemExit(f"--malloc keep: {refused}; run with --malloc glibc")


def pipeline_worker(rank: int, world: int, args: argparse.Namespace, round_: int) -> list[dict]:
    """Every multi-process variant, in this round's order."""
    from lightning_gpipe import GPipeStrategy

    set_malloc(args)
    device = C.device_for(rank, args.device)
    C.init_group(device)
    rows = []
    for workload in C.workloads(args.models, args):
        split = C.pipeline_balance(workload, world, max(1, args.batch_size // args.chunks), device)
        variants: list[tuple[str, Callable[[], float]]] = []
        for mode, split_backward in (("never", False), ("never", True), ("except_last", False)):

            def engine(mode: str = mode, split_backward: bool = split_backward) -> float:
                pipe, step = C.gpipe_step(
                    workload, args.chunks, mode, args.batch_size, device, split, split_backward=split_backward
                )
                try:
                    return C.step_seconds(step, device, args.warmup, args.steps)
                finally:
                    pipe.close()

            name = f"gpipe engine, checkpoint={mode}" + (", split backward" if split_backward else "")
            variants.append((name, engine))
        variants.append(
            (
                "gpipe Trainer, checkpoint=except_last",
                lambda: C.lightning_step_seconds(
                    workload,
                    GPipeStrategy(balance=split, chunks=args.chunks, reuse_freed_memory=args.malloc == "keep"),
                    world,
                    args.batch_size,
                    device,
                    args.warmup,
                    args.steps,
                ),
            )
        )
        for schedule in ("ScheduleGPipe", "Schedule1F1B"):
            variants.append(
                (
                    f"torch.distributed.pipelining {schedule}",
                    lambda s=schedule: C.step_seconds(
                        pipelining_step(workload, s, world, args.chunks, args.batch_size, device, split),
                        device,
                        args.warmup,
                        args.steps,
                    ),
                )
            )
        variants.append(
            (
                f"Lightning DDP, {world} processes",
                lambda: C.lightning_step_seconds(
                    workload, "ddp", world, args.batch_size, device, args.warmup, args.steps
                ),
            )
        )
        if round_ % 2:
            variants.reverse()
        for name, measure in variants:
            seconds = measure()
            rows.append(
                {
                    "model": workload.name,
                    "describe": workload.describe,
                    "variant": name,
                    "processes": world,
                    "threads": 1,
                    "step_s": seconds,
                }
            )
    return rows


def single_worker(rank: int, world: int, args: argparse.Namespace, threads: int) -> list[dict]:
    set_malloc(args)
    device = C.device_for(rank, args.device)
    rows = []
    for workload in C.workloads(args.models, args):
        seconds = C.step_seconds(single_step(workload, args.batch_size, device), device, args.warmup, args.steps)
        rows.append(
            {
                "model": workload.name,
                "describe": workload.describe,
                "variant": f"one process, {threads} thread{'s' * (threads > 1)}",
                "processes": 1,
                "threads": threads,
                "step_s": seconds,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=C.default_device())
    parser.add_argument("--stages", type=int, default=2, help="K: stages, processes, and threads of the one process")
    parser.add_argument("--chunks", type=int, default=8, help="M: micro-batches")
    parser.add_argument(
        "--models", nargs="+", default=["amoebanet", "transformer"], choices=["amoebanet", "transformer"]
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--malloc",
        choices=["keep", "glibc"],
        default="keep",
        help="glibc malloc thresholds for every variant: a gpipe stage's (keep freed memory) or glibc's own",
    )
    parser.add_argument("--out", default=C.default_out("peers"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    if args.stages < 2:
        parser.error("--stages must be at least 2: the peers are pipelines and data parallelism")

    rounds: dict[tuple, list[dict]] = {}
    for round_ in range(args.rounds):
        runs = [
            lambda: C.launch(pipeline_worker, args.stages, args, round_)[0],
            lambda: C.launch(single_worker, 1, args, 1, threads=1)[0],
            lambda: C.launch(single_worker, 1, args, args.stages, threads=args.stages)[0],
        ]
        for run in runs if round_ % 2 == 0 else runs[::-1]:
            for row in run():
                rounds.setdefault((row["model"], row["variant"]), []).append(row)

    info = C.machine(args.device)
    print(
        f"\nPeers at K={args.stages}, M={args.chunks}, batch {args.batch_size}, {args.device}, median of "
        f"{args.rounds} interleaved rounds of {args.steps} steps (spread: min-max of the rounds), "
        f"malloc: {args.malloc}\n"
        f"{C.describe_machine(info)}"
    )
    summary = []
    for model in args.models:
        ours = [r["step_s"] for r in rounds[(model, "gpipe engine, checkpoint=never")]]
        alone = [r["step_s"] for r in rounds[(model, "one process, 1 thread")]]
        rows = []
        for (name, _variant), per_round in rounds.items():
            if name != model:
                continue
            steps = [r["step_s"] for r in per_round]
            vs_ours = [o / s for o, s in zip(ours, steps)]
            vs_alone = [a / s for a, s in zip(alone, steps)]
            rows.append(
                {
                    **per_round[0],
                    "step_s": statistics.median(steps),
                    "step_s_rounds": steps,
                    "samples_per_s": args.batch_size / statistics.median(steps),
                    "vs_gpipe_never": statistics.median(vs_ours),
                    "vs_gpipe_never_spread": [min(vs_ours), max(vs_ours)],
                    "vs_one_thread": statistics.median(vs_alone),
                    "vs_one_thread_spread": [min(vs_alone), max(vs_alone)],
                }
            )
        summary += rows
        print(f"\n{rows[0]['describe']}\n")
        print(
            C.markdown(
                [
                    "variant",
                    "processes x threads",
                    "step ms",
                    "samples/s",
                    "throughput / gpipe engine (never)",
                    "throughput / one process, 1 thread",
                ],
                [
                    [
                        r["variant"],
                        f"{r['processes']} x {r['threads']}",
                        f"{1e3 * r['step_s']:.1f}",
                        f"{r['samples_per_s']:.1f}",
                        _spread(r["vs_gpipe_never"], r["vs_gpipe_never_spread"]),
                        _spread(r["vs_one_thread"], r["vs_one_thread_spread"]),
                    ]
                    for r in sorted(rows, key=lambda r: r["step_s"])
                ],
            )
        )
    C.write_json(args.out, {"machine": info, "args": vars(args), "rows": summary})


def _spread(median: float, spread: list[float]) -> str:
    return f"{median:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"


if __name__ == "__main__":
    main()
