"""The planner's split search against the split by time, on partially frozen backbones (fine-tuning).

    python benchmarks/split_search.py                          # K=2, M=8, checkpoint="never", 5 rounds
    python benchmarks/split_search.py --cases vgg:19 amoebanet:6 vgg:0 --rounds 3

Fine-tuning freezes the first layers of a backbone: they keep their forward but lose most of their
backward (no weight gradients, and before the first trained layer no input gradients either). A split by
time evens out each stage's forward plus backward; a fill-drain step pays the slowest stage of each
phase apart, so frozen layers crowd the first stage's forwards. ``balance="auto"`` and
``lightning-gpipe plan`` search near the split by time for the split whose replayed step is the shortest
(:func:`lightning_gpipe.balancing.plan.faster_split`). This measures whether the replay's choice is faster.

A case is ``model:N``: a model (``vgg``, the VGG-style stack of ``trainer.py``; ``amoebanet``; ``transformer``)
with its first N layers frozen. Rank 0 profiles the layers at the micro-batch size (``profile_layers``),
both splits are replayed, and where they differ both train through the Trainer
(``GPipeStrategy(balance=...)``, K processes with one thread each, SGD), in alternating order over
``--rounds`` rounds. Through the Trainer, not the bare engine: the Trainer's per-step collectives keep the
stages in step, as the replay does, while on the bare engine a stage with nothing to back-propagate (all
frozen) starts the next step's forwards during the others' drain, which no single-step replay sees. Per
case: each split's predicted and measured step (medians), and the measured gain, the median and spread
(min-max) of the per-round ratios. Prints a markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import _common as C
import torch
import torch.distributed as dist
from torch import nn
from trainer import conv_workload

from lightning_gpipe import GPipeStrategy, profile_layers
from lightning_gpipe.balancing.plan import CostModel, faster_split, simulate
from lightning_gpipe.engine.host_malloc import keep_freed_memory
from lightning_gpipe.engine.partition import balance as optimal_balance


def frozen(workload: C.Workload, layers: int) -> C.Workload:
    """``workload`` with the first ``layers`` layers of its backbone frozen (``requires_grad_(False)``)."""

    def build() -> nn.Sequential:
        backbone = workload.build()
        for layer in list(backbone)[:layers]:
            layer.requires_grad_(False)
        return backbone

    return dataclasses.replace(workload, name=f"{workload.name}, first {layers} frozen", build=build)


def case_workload(case: str, args: argparse.Namespace) -> C.Workload:
    name, layers = case.split(":")
    base = conv_workload(args.image) if name == "vgg" else C.workloads([name], args)[0]
    return frozen(base, int(layers))


def splits(workload: C.Workload, args: argparse.Namespace, stages: int) -> dict[str, Any]:
    """On rank 0: the profile's two splits and their replayed steps, in seconds."""
    torch.manual_seed(0)
    x, _ = workload.batch(max(1, args.batch_size // args.chunks), torch.device("cpu"))
    costs = profile_layers(workload.build(), x, repeats=args.repeats)
    model = CostModel([costs])
    by_time = tuple(optimal_balance(costs.time, stages))

    def replay(split: tuple[int, ...]) -> float:
        return simulate(model.step_costs(split, args.batch_size, args.chunks), args.checkpoint).step

    found, _ = faster_split(model, args.batch_size, args.chunks, args.checkpoint, by_time)
    return {"by_time": list(by_time), "searched": list(found), "predicted_s": [replay(by_time), replay(found)]}


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu")
    C.init_group(device)
    # the Trainer's default (reuse_freed_memory) for the profile too: under glibc's own thresholds every large
    # activation is mapped afresh, which made the profile's frozen convolutions 20-35% slower than in a step
    keep_freed_memory()
    box: list[Any] = [None]
    if rank == 0:
        box[0] = [splits(case_workload(case, args), args, world) for case in args.cases]
    dist.broadcast_object_list(box, src=0)
    planned: list[dict[str, Any]] = box[0]
    measured: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for case, plan in zip(args.cases, planned):
            workload = case_workload(case, args)
            names = ["by_time", "searched"] if plan["by_time"] != plan["searched"] else ["by_time"]
            for name in names if round_ % 2 == 0 else names[::-1]:
                strategy = GPipeStrategy(balance=plan[name], chunks=args.chunks, checkpoint=args.checkpoint)
                seconds = C.lightning_step_seconds(
                    workload, strategy, world, args.batch_size, device, args.warmup, args.steps
                )
                measured.append({"case": case, "split": name, "round": round_, "step_s": seconds})
    return {"planned": planned, "measured": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_workload_arguments(parser)
    parser.add_argument("--cases", nargs="+", default=["vgg:19", "amoebanet:6", "vgg:0"], help="model:frozen layers")
    parser.add_argument("--stages", type=int, default=2, help="K: stages and processes")
    parser.add_argument("--chunks", type=int, default=8, help="M: micro-batches")
    parser.add_argument("--checkpoint", default="never")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="profiling sweeps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=C.default_out("split_search"))
    args = parser.parse_args()

    result = C.launch(worker, args.stages, args)[0]
    rows, table = [], []
    for case, plan in zip(args.cases, result["planned"]):
        times = {
            name: [m["step_s"] for m in result["measured"] if m["case"] == case and m["split"] == name]
            for name in ("by_time", "searched")
        }
        same = plan["by_time"] == plan["searched"]
        gains = [1.0] * len(times["by_time"]) if same else [t / s for t, s in zip(times["by_time"], times["searched"])]
        predicted_gain = plan["predicted_s"][0] / plan["predicted_s"][1]
        row = {
            "case": case,
            **plan,
            "step_s": {k: v for k, v in times.items() if v},
            "predicted_gain": predicted_gain,
            "measured_gain": gains,
        }
        rows.append(row)
        searched_ms = "(same split)" if same else f"{1e3 * statistics.median(times['searched']):.1f}"
        table.append(
            [
                case,
                f"{plan['by_time']} / {plan['searched']}",
                f"{1e3 * plan['predicted_s'][0]:.1f} / {1e3 * plan['predicted_s'][1]:.1f}",
                f"{predicted_gain:.2f}x",
                f"{1e3 * statistics.median(times['by_time']):.1f} / {searched_ms}",
                f"{statistics.median(gains):.2f}x ({min(gains):.2f}-{max(gains):.2f})",
            ]
        )
    print(
        f"\nK={args.stages}, M={args.chunks}, checkpoint={args.checkpoint!r}, batch {args.batch_size}, "
        f"{args.rounds} rounds"
    )
    print(
        C.markdown(
            [
                "model:frozen layers",
                "split by time / searched",
                "replayed ms",
                "predicted gain",
                "measured ms",
                "measured gain",
            ],
            table,
        )
    )
    C.write_json(args.out, {"machine": C.machine("cpu"), "args": vars(args), "cases": rows})


if __name__ == "__main__":
    main()
