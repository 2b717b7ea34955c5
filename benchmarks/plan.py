"""The planner against measurement: predicted and measured step time and peak memory, and the automatic choice.

    python benchmarks/plan.py                       # CPU here: K = 1, 2; M = 1, 2, 4, 8, 16
    python benchmarks/plan.py --models main --chunks 1 4 --modes except_last

For each workload (AmoebaNet-D and the Transformer of ``_common.py``, and the main job's model,
``configs/amoebanet_digits.yaml``: AmoebaNet-D (9, 16) on 8x8 digits, a batch of 64), K and M, rank 0
profiles the backbone once at every micro-batch size the grid uses (``profile_for_plan``), the link
between the two processes is measured (``measure_link``), and the planner replays each step; then the
same step runs on the bare engine (Adam, one thread per process, the planner's split by time) and its
fastest step time and every stage's peak memory (resident set on the CPU, as ``memory.py`` reads it)
are measured. The grid is measured ``--rounds`` times, every cell once per round, and each cell keeps its
fastest step of all rounds (its memory is read in the first). Last, per workload and K, the planner's
choice over the whole grid (no memory cap on the CPU) is measured in the same rounds and set beside the
fastest measured cell.

It also prints GPipe's Table 2 for AmoebaNet-D as the planner predicts it (K = 2, 4, 8; M = 1, 4, 32;
speed-up over K = 2, M = 1) from a profile taken here: a prediction, not a measurement. On a GPU, the paper's
model and input (a profile of one GPU predicts the pipelines of 2 to 8):

    python benchmarks/plan.py --device cuda --table2-only --table2-filters 256 --table2-stem imagenet \
        --table2-image 224 --table2-classes 1000 --table2-profile t2.pt

``--table2-profile`` keeps the profile (or reads it back when the file exists), so the table can be predicted
again elsewhere, over another link (``--table2-link GBPS MICROSECONDS``, repeatable), without the device.
With ``--device cuda`` the grid runs on one GPU per process (K=1 on a machine with one GPU), where the
measured peak is CUDA's ``max_memory_allocated``.
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
    profile_for_plan,
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


def shared_profile(
    workload: C.Workload, batch_size: int, sizes: list[int], repeats: int, device: torch.device
) -> CostModel:
    """Rank 0 profiles on its device, every rank gets the same cost model."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        x, _ = workload.batch(batch_size, device)
        box[0] = profile_for_plan(workload.build(), x, sizes, device, repeats=repeats)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def measure(
    workload: C.Workload,
    chunks: int,
    mode: str,
    batch_size: int,
    split: list[int],
    warmup: int,
    steps: int,
    device: torch.device,
    peaks: bool = True,
) -> dict[str, Any]:
    """The fastest step's seconds (slowest rank), and, with ``peaks``, every stage's peak bytes: of its tensors,
    and of its resident set (CUDA's allocated bytes on a GPU) above the process's before the pipe.

    The fastest of ``steps``, not the median: on a shared machine other work only ever slows a step down.
    """
    MEM.malloc_for("memory")
    MEM._release()
    before = MEM.resident(device)
    made: list[torch.optim.Optimizer] = []

    def adam(parameters: Any) -> torch.optim.Optimizer:
        made.append(MEM.adam(parameters))
        return made[-1]

    pipe, step = C.gpipe_step(workload, chunks, mode, batch_size, device, split, adam)
    times, top = MEM.time_then_peak(step, device, warmup, steps, memory_steps=2 if peaks else 0)
    peak = top - before if peaks else 0
    tensors = tensor_peak(step, pipe, made[0]) if peaks else 0
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


def predicted_row(
    workload: C.Workload, model: CostModel, link: LinkModel, world: int, batch: int, chunks: int, mode: str
) -> dict[str, Any]:
    """One cell of the grid as the planner predicts it (the split by time for its micro-batch size)."""
    split = by_time(model, world, batch / chunks)
    predicted = simulate(model.step_costs(split, batch, chunks), mode, link)
    return {
        "model": workload.name,
        "describe": workload.describe,
        "stages": world,
        "chunks": chunks,
        "checkpoint": mode,
        "balance": split,
        "batch_size": batch,
        "predicted_step_s": predicted.step,
        "predicted_bubble": predicted.bubble,
        "predicted_peaks": [s.peak_memory for s in predicted.stages],
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
    device = C.device_for(rank, args.device)
    C.init_group(device)
    link = measure_link(1 - rank, device=device) if world == 2 else LinkModel()
    cells: list[dict[str, Any]] = []
    for workload in workloads(args):
        batch = args.main_batch if workload.name == "main" else args.batch_size
        MEM.malloc_for("time")  # the profile times the layers as the steps are timed
        model = shared_profile(workload, batch, micro_batch_sizes(batch, args.chunks), args.repeats, device)
        measure(workload, 1, "never", batch, by_time(model, world, batch), 1, 1, device)  # once-per-process state
        keys = [(m, mode) for m in args.chunks for mode in args.modes if not (m == 1 and mode == "except_last")]
        choice = plan(model, world, batch, link, chunks=args.chunks).choice  # 1 and except_last: the same as never
        key = (choice.chunks, choice.checkpoint)
        rows = {k: predicted_row(workload, model, link, world, batch, *k) for k in [*keys, key]}
        # The grid is measured in rounds, each cell once per round, and each keeps its fastest step over all of
        # them, as the profile keeps each layer's fastest round: a slow spell of a shared VM lasts longer than one
        # cell's steps (measured on CPU-2: one K=2 cell's fastest of 5 steps went from 150 to 209 ms between four
        # runs a minute apart, its prediction within 147-152 ms), and now costs a cell one round, not its figure.
        for round_ in range(args.rounds):
            for k, row in rows.items():
                measured = measure(
                    workload, *k, batch, row["balance"], args.warmup, args.steps, device, peaks=round_ == 0
                )
                row["measured_step_s"] = min(row.get("measured_step_s", float("inf")), measured["step_s"])
                if round_ == 0:
                    row["measured_peaks"], row["measured_tensor_peaks"] = measured["peaks"], measured["tensor_peaks"]
        grid = {k: rows[k] for k in keys}
        cells.extend(grid.values())
        if key not in grid:
            cells.append(rows[key])
        chosen = rows[key]
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


# torchgpipe's AmoebaNet-D (18, 256) speed benchmark, tuned for 8 P40 GPUs: (K, M) -> (batch, checkpoint mode)
TORCHGPIPE_TABLE2 = {
    (2, 1): (96, "always"),
    (2, 4): (256, "except_last"),
    (2, 32): (1280, "except_last"),
    (4, 1): (160, "always"),
    (4, 4): (360, "except_last"),
    (4, 32): (1152, "except_last"),
    (8, 1): (196, "always"),
    (8, 4): (480, "except_last"),
    (8, 32): (1280, "except_last"),
}


def table_two_cells(args: argparse.Namespace) -> dict[tuple[int, int], tuple[int, str]]:
    """Each cell's batch and checkpoint mode: one batch for all (``fixed``), or torchgpipe's per cell."""
    if args.table2_settings == "torchgpipe":
        return TORCHGPIPE_TABLE2
    return {(k, m): (args.table2_batch, "except_last") for k in (2, 4, 8) for m in (1, 4, 32)}


def table_two(args: argparse.Namespace) -> dict[str, Any]:
    """GPipe's Table 2 for AmoebaNet-D, predicted from one device's profile: throughput over K=2, M=1.

    The profile is taken on ``--device`` (one thread on the CPU), or read from ``--table2-profile`` where that
    file exists (and written there after a fresh profile), so a GPU's profile can be replayed anywhere. Each
    link of ``--table2-link`` gives one more table; the first is an ideal link.
    """
    cells = table_two_cells(args)
    path = args.table2_profile
    if path and os.path.exists(path):
        saved = torch.load(path, weights_only=False)
        model, describe = saved["model"], saved["describe"]
    else:
        device = C.device_for(0, args.device)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        backbone = amoebanetd(args.table2_classes, args.table2_layers, args.table2_filters, stem=args.table2_stem)
        sizes = sorted({s for (_, chunks), (batch, _) in cells.items() for s in micro_batch_sizes(batch, [chunks])})
        x = torch.randn(sizes[-1], 3, args.table2_image, args.table2_image, device=device)
        model = profile_for_plan(backbone, x, sizes, device, repeats=2)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU, one thread"
        describe = (
            f"AmoebaNet-D ({args.table2_layers}, {args.table2_filters}), {args.table2_stem} stem, "
            f"{args.table2_image}x{args.table2_image} images, {args.table2_classes} classes; profiled on {where}"
        )
        if path:
            torch.save({"model": model, "describe": describe}, path)
    links = [LinkModel()] + [LinkModel(gbps * 1e9, us * 1e-6) for gbps, us in args.table2_link]
    tables = []
    for link in links:
        speed: dict[str, float] = {}
        steps: dict[str, float] = {}
        for (stages, chunks), (batch, mode) in cells.items():
            split = by_time(model, stages, batch / chunks)
            step = simulate(model.step_costs(split, batch, chunks), mode, link).step
            steps[f"K={stages} M={chunks}"], speed[f"K={stages} M={chunks}"] = step, batch / step
        base = speed["K=2 M=1"]
        tables.append(
            {
                "link": "ideal" if link == LinkModel() else f"{link.bandwidth / 1e9:g} GB/s, {link.latency * 1e6:g} us",
                "step_s": steps,
                "samples_per_s": speed,
                "speedup": {k: v / base for k, v in speed.items()},
            }
        )
    settings = {f"K={k} M={m}": {"batch": b, "checkpoint": c} for (k, m), (b, c) in cells.items()}
    how = "torchgpipe's batch and checkpoint mode per cell"
    if args.table2_settings == "fixed":
        how = f"a batch of {args.table2_batch}, except_last"
    return {"describe": f"{describe}; {how}; split by time", "settings": settings, "tables": tables}


def report(cells: list[dict[str, Any]]) -> None:
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


def report_table_two(t2: dict[str, Any]) -> None:
    for table in t2["tables"]:
        print(f"\nGPipe's Table 2, predicted ({t2['describe']}; link: {table['link']}): throughput over K=2, M=1\n")
        rows = [[f"K={k}", *[f"{table['speedup'][f'K={k} M={m}']:.2f}x" for m in (1, 4, 32)]] for k in (2, 4, 8)]
        print(C.markdown(["", "M=1", "M=4", "M=32"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=["never", "except_last", "always"])
    parser.add_argument("--models", nargs="+", default=["amoebanet", "transformer", "main"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--main-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per cell and round")
    parser.add_argument("--rounds", type=int, default=3, help="times the grid is measured; each cell keeps its fastest")
    parser.add_argument("--repeats", type=int, default=5, help="profiling sweeps per micro-batch size")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per process")
    parser.add_argument("--table2-layers", type=int, default=18)
    parser.add_argument("--table2-filters", type=int, default=64)
    parser.add_argument("--table2-stem", choices=["small", "imagenet"], default="small")
    parser.add_argument("--table2-image", type=int, default=32)
    parser.add_argument("--table2-classes", type=int, default=C.CLASSES)
    parser.add_argument(
        "--table2-batch", type=int, default=128, help="every cell's batch, with --table2-settings fixed"
    )
    parser.add_argument(
        "--table2-settings", choices=["fixed", "torchgpipe"], default="fixed",
        help="torchgpipe: that benchmark's batch (96 to 1280) and checkpoint mode per cell, for 224x224 images",
    )  # fmt: skip
    parser.add_argument("--table2-profile", help="a file to keep the Table 2 profile in, or to read it from")
    parser.add_argument(
        "--table2-link", type=float, nargs=2, action="append", default=[], metavar=("GBPS", "MICROSECONDS"),
        help="one more Table 2 over a link of this bandwidth (GB/s) and latency (us); repeatable",
    )  # fmt: skip
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--skip-table2", action="store_true")
    group.add_argument("--table2-only", action="store_true", help="only Table 2: no grid is measured")
    parser.add_argument("--out", default=C.default_out("plan"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not args.table2_only and max(args.stages) > torch.cuda.device_count():
        parser.error(f"--stages {max(args.stages)} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))  # as memory.py: freed blocks leave the RSS
    cells: list[dict[str, Any]] = []
    for stages in [] if args.table2_only else args.stages:
        cells += C.launch(worker, stages, args)[0]
    t2 = {"describe": "skipped", "tables": []}
    if not args.skip_table2:
        t2 = table_two(args)
    if cells:
        report(cells)
    report_table_two(t2)
    C.write_json(args.out, {"machine": C.machine(args.device), "args": vars(args), "cells": cells, "table2": t2})


if __name__ == "__main__":
    main()
