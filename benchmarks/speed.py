"""Speed: training throughput of K stages and M micro-batches, normalized to one stage, beside the bubble bound.

    python benchmarks/speed.py                      # K = 1, 2 on CPU here; K = 1, 2, 4, 8 where there are cores or GPUs
    python benchmarks/speed.py --stages 1 2 --chunks 1 4 8 --models transformer
    python benchmarks/speed.py --stages 1 2 --chunks 1 4 8 --models unet     # skip connections across stages

The shape of GPipe's Table 2, on two backbones: AmoebaNet-D (activation-heavy convolutions on
32x32 images) and a stack of Transformer blocks; and, with ``--models unet``, torchgpipe's U-Net,
whose long skip connections go from each encoder level's stage straight to its decoder level's.
Every cell trains the same model on the same batch with the bare engine (``GPipe``; ``overhead.py``
measures the Trainer on top), one process per stage with one thread each (so K stages use K cores),
an SGD step included, the split by measured time.
Per K and M it reports:

- speed-up: throughput over that of K=1 with the same M (one process, micro-batching and
  re-materialization alike), so only pipelining differs;
- efficiency: speed-up / K, beside the bubble bound M/(M+K-1), the best a fill-drain schedule can do,
  and their ratio (the target is >= 0.9 once M >= 4K);
- GPipe's own measure, throughput over that of K=2 with M=1 (3.48x at K=8, M=32 in the paper).

Each K runs in fresh processes; the Ks alternate over ``--rounds`` rounds. Each cell gives the median
over the rounds; the ratios (speed-up, efficiency, of bound) are medians of per-round ratios, each
against the same round's K=1, with the spread (min-max) of "of bound". Prints markdown tables, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics

import _common as C
import torch

from lightning_gpipe.engine.schedule import bubble_fraction


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    device = C.device_for(rank, args.device)
    C.init_group(device)
    cells = []
    for workload in C.workloads(args.models, args):
        split = C.pipeline_balance(workload, world, max(1, args.batch_size // 8), device)
        for chunks in args.chunks:
            pipe, step = C.gpipe_step(workload, chunks, args.checkpoint, args.batch_size, device, split)
            seconds = C.step_seconds(step, device, args.warmup, args.steps)
            pipe.close()
            cells.append(
                {
                    "model": workload.name,
                    "describe": workload.describe,
                    "stages": world,
                    "chunks": chunks,
                    "balance": split,
                    "step_s": seconds,
                    "samples_per_s": args.batch_size / seconds,
                }
            )
    return cells


def available_stages(device: str) -> list[int]:
    limit = torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1)
    return [k for k in (1, 2, 4, 8) if k <= limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=C.default_device())
    parser.add_argument("--stages", type=int, nargs="+", help="K values (default: 1, 2, 4, 8 as cores or GPUs allow)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument(
        "--models", nargs="+", default=["amoebanet", "transformer"], choices=["amoebanet", "transformer", "unet"]
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=C.default_out("speed"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    stages = args.stages or available_stages(args.device)
    if 1 not in stages:
        parser.error("--stages must include 1: every figure is normalized to one stage")

    runs: dict[tuple, list[dict]] = {}
    for round_ in range(args.rounds):
        order = stages if round_ % 2 == 0 else stages[::-1]
        for k in order:
            for cell in C.launch(worker, k, args)[0]:
                runs.setdefault((cell["model"], k, cell["chunks"]), []).append(cell)
    best: dict[tuple, dict] = {}
    for key, per_round in runs.items():
        steps = [c["step_s"] for c in per_round]
        median = statistics.median(steps)
        best[key] = {
            **per_round[0],
            "step_s": median,
            "step_s_rounds": steps,
            "samples_per_s": args.batch_size / median,
        }
    cells = list(best.values())
    for cell in cells:
        k, m = cell["stages"], cell["chunks"]
        one = best[(cell["model"], 1, m)]
        speedups = [a / b for a, b in zip(one["step_s_rounds"], cell["step_s_rounds"])]  # round by round
        cell["speedup"] = statistics.median(speedups)
        cell["efficiency"] = cell["speedup"] / k
        cell["bubble_bound"] = 1.0 - bubble_fraction(m, k)  # M / (M + K - 1)
        cell["of_bound"] = cell["efficiency"] / cell["bubble_bound"]
        cell["of_bound_spread"] = [min(speedups) / k / cell["bubble_bound"], max(speedups) / k / cell["bubble_bound"]]
        if (cell["model"], 1, 1) in best:
            cell["over_k1_m1"] = cell["samples_per_s"] / best[(cell["model"], 1, 1)]["samples_per_s"]
        if (cell["model"], 2, 1) in best:
            cell["over_k2_m1"] = cell["samples_per_s"] / best[(cell["model"], 2, 1)]["samples_per_s"]

    info = C.machine(args.device)
    print(
        f"\nThroughput by stages K and micro-batches M, batch {args.batch_size}, checkpoint={args.checkpoint!r}, "
        f"{args.device}, median of {args.rounds} rounds of {args.steps} steps\n{C.describe_machine(info)}"
    )
    for model in args.models:
        rows = []
        for m in args.chunks:
            row: list = [m, f"{best[(model, 1, m)]['samples_per_s']:.1f}"]
            for k in stages[1:]:
                c = best[(model, k, m)]
                row += [
                    f"{c['speedup']:.2f}x",
                    f"{c['efficiency']:.2f} / {c['bubble_bound']:.2f}",
                    f"{c['of_bound']:.2f} ({c['of_bound_spread'][0]:.2f}-{c['of_bound_spread'][1]:.2f})",
                ]
            rows.append(row)
        headers = ["M", "K=1 samples/s"]
        for k in stages[1:]:
            headers += [f"K={k} speed-up", f"K={k} efficiency / bound", f"K={k} of bound"]
        print(f"\n{best[(model, 1, args.chunks[0])]['describe']}\n")
        print(C.markdown(headers, rows))
        if (model, 2, 1) in best:  # GPipe's Table 2 measure: the largest K and M over K=2, M=1
            top = best[(model, max(stages), max(args.chunks))]
            fastest = max((c for c in cells if c["model"] == model), key=lambda c: c["samples_per_s"])
            print(
                f"\nGPipe's measure, K={top['stages']}, M={top['chunks']} over K=2, M=1: {top['over_k2_m1']:.2f}x "
                f"(the fastest cell, K={fastest['stages']}, M={fastest['chunks']}: {fastest['over_k2_m1']:.2f}x)"
            )
    print(
        "\nspeed-up: throughput over K=1 with the same M; efficiency: speed-up / K; bound: M/(M+K-1), "
        "the fill-drain bubble's limit; of bound: efficiency / bound (min-max over the rounds)."
    )
    C.write_json(args.out, {"machine": info, "args": vars(args), "stages": stages, "cells": cells})


if __name__ == "__main__":
    main()
