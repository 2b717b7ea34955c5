"""The planner against measurement: predicted and measured step time and peak memory, and the automatic choice.

    python benchmarks/plan.py                       # CPU here: K = 1, 2; M = 1, 2, 4, 8, 16
    python benchmarks/plan.py --models main --chunks 1 4 --modes except_last

For each workload (AmoebaNet-D and the Transformer of ``_common.py``, and the main job's model,
``configs/amoebanet_digits.yaml``: AmoebaNet-D (9, 16) on 8x8 digits, a batch of 64), K and M, rank 0
profiles the backbone once at every micro-batch size the grid uses (``profile_for_plan``), the link
between the two processes is measured (``measure_link``), and the planner replays each step; then the
same step runs on the bare engine (Adam, one thread per process, the planner's split by time) and its
fastest step time and every stage's peak memory (resident set on the CPU, as ``memory.py`` reads it)
are measured. Last, per workload and K, the planner's choice over the whole grid (no memory cap on the
CPU) is measured too and set beside the fastest measured cell.

It also prints GPipe's Table 2 for AmoebaNet-D as the planner predicts it (K = 2, 4, 8; M = 1, 4, 32;
speed-up over K = 2, M = 1) from a profile taken here: a prediction, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import _common as C
import memory as MEM
import torch
import torch.distributed as dist

from lightning_gpipe import GPipe
from lightning_gpipe.balancing.plan import (
    CostModel,
    LinkModel,
    LiveBytes,
    measure_link,
    micro_batch_sizes,
    plan,
    simulate,
)
from lightning_gpipe.balancing.plan.search import by_time
from lightning_gpipe.models import amoebanetd

MIB = 2**20


def main_job_workload() -> C.Workload:
    """The model and input of ``configs/amoebanet_digits.yaml``: AmoebaNet-D (9, 16), small stem, 8x8 grey digits."""

    def batch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(n)
        return torch.randn(n, 1, 8, 8, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)

    return C.Workload(
        "main",
        "main job: AmoebaNet-D (9, 16), 8x8 digits",
        lambda: amoebanetd(10, 9, 16, in_channels=1, stem="small"),
        batch,
    )


def shared_profile(workload: C.Workload, batch_size: int, sizes: list[int], repeats: int) -> CostModel:
    """Rank 0 profiles, every rank gets the same cost model."""
    from lightning_gpipe.balancing.plan import profile_for_plan

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        x, _ = workload.batch(batch_size, torch.device("cpu"))
        box[0] = profile_for_plan(workload.build(), x, sizes, repeats=repeats)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def measure(
    workload: C.Workload, chunks: int, mode: str, batch_size: int, split: list[int], warmup: int, steps: int
) -> dict[str, Any]:
    """The fastest step's seconds (slowest rank), and every stage's peak bytes: of its tensors, and of its
    resident set above the process's before the pipe.

    The fastest of ``steps``, not the median: on a shared machine other work only ever slows a step down.
    """
    device = torch.device("cpu")
    MEM.malloc_for("memory")
    MEM._release()
    before = MEM.resident(device)
    made: list[torch.optim.Optimizer] = []

    def adam(parameters: Any) -> torch.optim.Optimizer:
        made.append(MEM.adam(parameters))
        return made[-1]

    pipe, step = C.gpipe_step(workload, chunks, mode, batch_size, device, split, adam)
    times, top = MEM.time_then_peak(step, device, warmup, steps)
    peak = top - before
    tensors = tensor_peak(step, pipe, made[0])
    pipe.close()
    made.clear()
    del pipe, step
    MEM._release()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (min(times), peak, tensors))
    return {
        "step_s": max(t for t, _, _ in every),
        "peaks": [p for _, p, _ in every],
        "tensor_peaks": [b for _, _, b in every],
    }


def tensor_peak(step: Any, pipe: GPipe, optimizer: torch.optim.Optimizer) -> int:
    """The most bytes of tensors this process held during one more ``step`` (see ``LiveBytes``): what the planner
    predicts, and what CUDA's ``max_memory_allocated`` reports on a GPU. Parameters, buffers, gradients and the
    optimizer's state count from the start; the batch and a link's reused frames from their first use."""
    with LiveBytes.training(pipe.parameters(), optimizer, pipe.buffers()) as live:
        live.mark("start")
        step()
    return live.peak("start")


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    C.init_group(torch.device("cpu"))
    link = measure_link(1 - rank) if world == 2 else LinkModel()
    cells: list[dict[str, Any]] = []
    for workload in workloads(args):
        batch = args.main_batch if workload.name == "main" else args.batch_size
        MEM.malloc_for("time")  # the profile times the layers as the steps are timed
        model = shared_profile(workload, batch, micro_batch_sizes(batch, args.chunks), args.repeats)
        measure(workload, 1, "never", batch, by_time(model, world, batch), 1, 1)  # once-per-process runtime state
        grid: dict[tuple[int, str], dict[str, Any]] = {}

        def cell(chunks: int, mode: str) -> dict[str, Any]:
            split = by_time(model, world, batch / chunks)
            predicted = simulate(model.step_costs(split, batch, chunks), mode, link)
            measured = measure(workload, chunks, mode, batch, split, args.warmup, args.steps)
            row = {
                "model": workload.name,
                "describe": workload.describe,
                "stages": world,
                "chunks": chunks,
                "checkpoint": mode,
                "balance": split,
                "batch_size": batch,
                "predicted_step_s": predicted.step,
                "measured_step_s": measured["step_s"],
                "predicted_bubble": predicted.bubble,
                "predicted_peaks": [s.peak_memory for s in predicted.stages],
                "measured_peaks": measured["peaks"],
                "measured_tensor_peaks": measured["tensor_peaks"],
            }
            cells.append(row)
            return row

        for chunks in args.chunks:
            for mode in args.modes:
                if chunks == 1 and mode == "except_last":
                    continue  # the same as never with one micro-batch
                grid[(chunks, mode)] = cell(chunks, mode)
        choice = plan(model, world, batch, link, chunks=args.chunks).choice
        key = (choice.chunks, choice.checkpoint)
        chosen = grid[key] if key in grid else cell(*key)
        best = min(grid.values(), key=lambda r: r["measured_step_s"])
        cells.append(
            {
                "model": workload.name,
                "stages": world,
                "auto": True,
                "choice": {"chunks": choice.chunks, "checkpoint": choice.checkpoint, "balance": list(choice.balance)},
                "choice_measured_step_s": chosen["measured_step_s"],
                "best": {"chunks": best["chunks"], "checkpoint": best["checkpoint"]},
                "best_measured_step_s": best["measured_step_s"],
            }
        )
    if rank == 0:
        cells.append({"link": {"bandwidth": link.bandwidth, "latency": link.latency}, "stages": world})
    return cells


def workloads(args: argparse.Namespace) -> list[C.Workload]:
    chosen = [w for w in C.workloads([m for m in args.models if m != "main"], args)]
    return chosen + ([main_job_workload()] if "main" in args.models else [])


def table_two(args: argparse.Namespace) -> dict[str, Any]:
    """GPipe's Table 2 for AmoebaNet-D, predicted from a profile here: speed-up over K=2, M=1."""
    from lightning_gpipe.balancing.plan import profile_for_plan

    torch.set_num_threads(1)
    workload = C.amoebanet_workload(args.table2_layers, args.table2_filters, args.image)
    batch = args.table2_batch
    torch.manual_seed(0)
    x, _ = workload.batch(batch, torch.device("cpu"))
    model = profile_for_plan(workload.build(), x, micro_batch_sizes(batch, [1, 4, 32]), repeats=2)
    speed: dict[str, float] = {}
    for stages in (2, 4, 8):
        for chunks in (1, 4, 32):
            split = by_time(model, stages, batch / chunks)
            speed[f"K={stages} M={chunks}"] = simulate(model.step_costs(split, batch, chunks), "except_last").step
    base = speed["K=2 M=1"]
    return {
        "describe": f"{workload.describe}, a batch of {batch}, split by time, except_last, an ideal link",
        "speedup": {k: base / v for k, v in speed.items()},
    }


def report(cells: list[dict[str, Any]], t2: dict[str, Any]) -> None:
    rows, time_errors, tensor_errors, resident_errors = [], [], [], []
    for c in cells:
        if "predicted_step_s" not in c:
            continue
        te = c["predicted_step_s"] / c["measured_step_s"] - 1
        pm, tm, rm = max(c["predicted_peaks"]), max(c["measured_tensor_peaks"]), max(c["measured_peaks"])
        time_errors.append(abs(te))
        tensor_errors.append(abs(pm / tm - 1))
        resident_errors.append(abs(pm / rm - 1))
        rows.append(
            [
                c["model"], c["stages"], c["chunks"], c["checkpoint"], c["balance"],
                f"{c['predicted_step_s'] * 1e3:.1f}", f"{c['measured_step_s'] * 1e3:.1f}", f"{te:+.0%}",
                f"{pm / MIB:.1f}", f"{tm / MIB:.1f}", f"{pm / tm - 1:+.0%}", f"{rm / MIB:.1f}", f"{pm / rm - 1:+.0%}",
            ]
        )  # fmt: skip
    headers = ["model", "K", "M", "checkpoint", "balance", "predicted ms", "measured ms", "error",
               "predicted MiB", "tensors MiB", "error", "resident MiB", "error"]  # fmt: skip
    print(C.markdown(headers, rows))

    def share(errors: list[float], bound: float) -> str:
        within = sum(e <= bound for e in errors)
        return f"{within}/{len(errors)} (median {statistics.median(errors):.0%}, max {max(errors):.0%})"

    print(
        f"\nstep time within 15%: {share(time_errors, 0.15)}; peak memory within 20%: tensors "
        f"{share(tensor_errors, 0.20)}, resident set {share(resident_errors, 0.20)}"
    )
    auto_rows = [
        [
            c["model"], c["stages"], f"M={c['choice']['chunks']} {c['choice']['checkpoint']}",
            f"{c['choice_measured_step_s'] * 1e3:.1f}", f"M={c['best']['chunks']} {c['best']['checkpoint']}",
            f"{c['best_measured_step_s'] * 1e3:.1f}", f"{c['best_measured_step_s'] / c['choice_measured_step_s']:.2f}",
        ]
        for c in cells if c.get("auto")
    ]  # fmt: skip
    print("\nThe automatic choice (no memory cap), measured, against the fastest measured cell:\n")
    print(C.markdown(["model", "K", "choice", "ms", "fastest measured", "ms", "throughput ratio"], auto_rows))
    print(f"\nGPipe's Table 2, predicted ({t2['describe']}): speed-up over K=2, M=1\n")
    t2_rows = [[f"K={k}", *[f"{t2['speedup'][f'K={k} M={m}']:.2f}x" for m in (1, 4, 32)]] for k in (2, 4, 8)]
    print(C.markdown(["", "M=1", "M=4", "M=32"], t2_rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["never", "except_last", "always"])
    parser.add_argument("--models", nargs="+", default=["amoebanet", "transformer", "main"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--main-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="profiling sweeps per micro-batch size")
    parser.add_argument("--table2-layers", type=int, default=18)
    parser.add_argument("--table2-filters", type=int, default=64)
    parser.add_argument("--table2-batch", type=int, default=128)
    parser.add_argument("--skip-table2", action="store_true")
    parser.add_argument("--out", default=C.default_out("plan"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))  # as memory.py: freed blocks leave the RSS
    cells: list[dict[str, Any]] = []
    for stages in args.stages:
        cells += C.launch(worker, stages, args)[0]
    t2 = {"describe": "skipped", "speedup": {f"K={k} M={m}": float("nan") for k in (2, 4, 8) for m in (1, 4, 32)}}
    if not args.skip_table2:
        t2 = table_two(args)
    report(cells, t2)
    C.write_json(args.out, {"machine": C.machine("cpu"), "args": vars(args), "cells": cells, "table2": t2})


if __name__ == "__main__":
    main()
