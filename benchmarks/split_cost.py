"""What input gradients first (``split_backward=True``) cost and save per micro-batch, on one device.

    python benchmarks/split_cost.py --device cuda --amoebanet-layers 18 --amoebanet-filters 128 \
        --blocks 8 --width 512 --sequence 128 --batch-size 64 --chunks 8

A split drain pays off where a stage's input gradient is ready well before its weight gradients, and where
the split's extra autograd calls cost little beside the kernels. Both can be measured in one process, on
one device, which is what a machine with a single GPU allows (a pipeline of K >= 2 over NCCL needs K GPUs).
Per workload, the second half of the Sequential stands for a stage, fed micro-batches of
``batch_size / chunks`` samples; medians of ``--passes`` backwards, each waited for on the device:

- whole: the stage's backward as one ``torch.autograd.backward``;
- input: :func:`~lightning_gpipe.engine.split_backward.inputs_first` until the input gradient exists (what
  the upstream stage waits for in a split drain);
- weights: the :class:`~lightning_gpipe.engine.split_backward.WeightPass` after it.

From these, an **estimate** (not a measurement) for K equal stages like this one in a fill-drain step of
``(M + K - 1) * (forward + whole)``: the input gradient of the last micro-batch reaches the first stage
``(K - 1) * (whole - input)`` sooner, while every stage but the first pays ``input + weights - whole`` more
per micro-batch on the drain's path, ``M - 1`` times. The step's predicted gain is the step over the step
less that saving.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _common as C
import torch
from torch import Tensor, nn

from lightning_gpipe.engine.microbatch import map_tensors, tensors
from lightning_gpipe.engine.split_backward import inputs_first


def _timed(fn: Any, device: torch.device) -> tuple[float, Any]:
    C.synchronize(device)
    start = time.perf_counter()
    result = fn()
    C.synchronize(device)
    return time.perf_counter() - start, result


def measure(stage: nn.Sequential, x: Any, device: torch.device, passes: int) -> dict[str, float]:
    """Median seconds of the stage's forward, whole backward, and split backward (input, then weights).

    ``x`` is the stage's input, a tensor or a tuple of them (AmoebaNet's cells pass two), the floating ones
    requiring gradients as a received activation does."""
    leaves = [t for t in tensors(x) if t.requires_grad]
    grads = [torch.randn_like(t) for t in tensors(stage(x)) if t.requires_grad]

    def outputs() -> list[Tensor]:
        for t in leaves:
            t.grad = None
        stage.zero_grad(set_to_none=True)
        return [t for t in tensors(stage(x)) if t.requires_grad]

    forward, whole, inputs, weights = [], [], [], []
    for i in range(passes + 2):  # two warm-ups
        seconds, out = _timed(outputs, device)
        b, _ = _timed(lambda: torch.autograd.backward(out, grads), device)
        out = outputs()
        first, weight_pass = _timed(lambda: inputs_first(out, grads, leaves), device)
        if weight_pass is None:
            raise RuntimeError("this stage's backward cannot be split (see split_backward.inputs_first)")
        second, _ = _timed(weight_pass, device)
        if i >= 2:
            forward.append(seconds)
            whole.append(b)
            inputs.append(first)
            weights.append(second)
    columns = (forward, whole, inputs, weights)
    return {k: statistics.median(v) for k, v in zip(("forward", "whole", "input", "weights"), columns)}


def predicted_gain(times: dict[str, float], stages: int, chunks: int) -> float:
    """The fill-drain step over the same step with the split drain, for ``stages`` equal stages (module docstring)."""
    step = (chunks + stages - 1) * (times["forward"] + times["whole"])
    overhead = times["input"] + times["weights"] - times["whole"]
    saving = (stages - 1) * (times["whole"] - times["input"]) - (chunks - 1) * overhead
    return step / (step - saving)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["amoebanet", "transformer"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8, help="M: the micro-batch is batch_size / chunks samples")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8], help="K values for the estimate")
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=C.default_device())
    parser.add_argument("--out", default=C.default_out("split_cost"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    device = C.device_for(0, args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    micro = args.batch_size // args.chunks
    rows, cells = [], []
    for workload in C.workloads(args.models, args):
        torch.manual_seed(0)
        model = workload.build().to(device)
        half = len(model) // 2
        x, _ = workload.batch(micro, device)
        with torch.no_grad():
            x = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), model[:half](x))
        times = measure(model[half:], x, device, args.passes)
        gains = {k: predicted_gain(times, k, args.chunks) for k in args.stages}
        cells.append({"model": workload.describe, "layers": [half, len(model)], "micro_batch": micro} | times)
        cells[-1]["predicted_gain"] = {str(k): v for k, v in gains.items()}
        ms = [f"{times[k] * 1e3:.2f}" for k in ("forward", "whole", "input", "weights")]
        split = (times["input"] + times["weights"]) / times["whole"]
        rows.append([workload.describe, *ms, f"{split:.2f}", *(f"{gains[k]:.3f}x" for k in args.stages)])
    headers = ["model (second half)", "forward ms", "whole backward ms", "input ms", "weights ms", "split / whole"]
    headers += [f"estimate K={k}, M={args.chunks}" for k in args.stages]
    print(f"{C.describe_machine(C.machine(args.device))}; micro-batches of {micro}")
    print(C.markdown(headers, rows))
    C.write_json(args.out, {"machine": C.machine(args.device), "args": vars(args), "cells": cells})


if __name__ == "__main__":
    main()
