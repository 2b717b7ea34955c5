"""How far a profile's layer times, summed, part from one whole forward and backward of the same model.

    python benchmarks/profile_sum.py --device cuda --amoebanet-layers 18 --amoebanet-filters 128 \
        --blocks 8 --width 512 --sequence 128 --batches 64 8

The planner and ``balance="time"`` add up layers timed one at a time (``profile_layers``), each waited for
on the device. A training step issues the same kernels without those waits: on a GPU the host runs ahead of
the device, so the step can take as little as the larger of the two, not their sum. Per workload and batch
size, one process, no engine (the median of several passes each):

- whole: one forward and backward of the Sequential, waited for at the end only;
- host: the same pass until the host has issued it, before the wait (on the CPU, the whole);
- per layer: each layer's forward and backward waited for, summed (what a profile measures);
- per layer, hooked: the same with a Python call per tensor autograd saves (the profile's counting sweep);
- profile: ``profile_layers``'s forward and backward times, summed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import _common as C
import torch
from torch import nn

from lightning_gpipe.balancing.profiling import profile_layers
from lightning_gpipe.engine.microbatch import map_tensors, tensors


def whole_pass(
    workload: C.Workload, model: nn.Sequential, x: Any, y: Any, device: torch.device, passes: int
) -> tuple[float, float]:
    """Median seconds of a whole forward and backward, and of its host part (until the wait)."""
    totals, hosts = [], []
    for i in range(passes + 2):  # two warm-ups
        C.synchronize(device)
        start = time.perf_counter()
        workload.loss(model(x), y).backward()
        issued = time.perf_counter()
        C.synchronize(device)
        if i >= 2:
            hosts.append(issued - start)
            totals.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(totals), statistics.median(hosts)


def layer_by_layer(model: nn.Sequential, x: Any, device: torch.device, passes: int, hooked: bool) -> float:
    """Median over passes of the summed, waited-for forward and backward of each layer on its own."""
    sums = []
    for i in range(passes + 1):  # one warm-up
        total, h = 0.0, x
        for layer in model:
            h = map_tensors(lambda t: t.detach().requires_grad_(t.is_floating_point()), h)
            hook = (
                torch.autograd.graph.saved_tensors_hooks(lambda t: (t.untyped_storage().data_ptr(), t)[1], lambda t: t)
                if hooked
                else contextlib.nullcontext()
            )
            C.synchronize(device)
            start = time.perf_counter()
            with hook:
                out = layer(h)
            outputs = [t for t in tensors(out) if t.requires_grad]
            wrt = [t for t in tensors(h) if t.requires_grad] + [p for p in layer.parameters() if p.requires_grad]
            torch.autograd.grad(outputs, wrt, [torch.ones_like(t) for t in outputs], allow_unused=True)
            C.synchronize(device)
            total += time.perf_counter() - start
            h = out
        if i:
            sums.append(total)
    return statistics.median(sums)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["amoebanet", "transformer"])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=C.default_device())
    parser.add_argument("--out", default=C.default_out("profile_sum"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    device = C.device_for(0, args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows, cells = [], []
    for workload in C.workloads(args.models, args):
        torch.manual_seed(0)
        model = workload.build().to(device)
        for batch in args.batches:
            x, y = workload.batch(batch, device)
            whole, host = whole_pass(workload, model, x, y, device, args.passes)
            plain = layer_by_layer(model, x, device, args.passes, hooked=False)
            hooked = layer_by_layer(model, x, device, args.passes, hooked=True)
            profile = profile_layers(model, x, device, repeats=args.passes)
            summed = sum(profile.forward) + sum(profile.backward)
            cell = {"model": workload.describe, "batch": batch, "whole_s": whole, "host_s": host}
            cell |= {"per_layer_s": plain, "per_layer_hooked_s": hooked, "profile_s": summed}
            cells.append(cell)
            ms = [f"{v * 1e3:.1f}" for v in (whole, host, plain, hooked, summed)]
            rows.append([workload.describe, batch, *ms, f"{summed / whole:.2f}"])
    headers = ["model", "batch", "whole ms", "host ms", "per layer ms", "per layer, hooked ms", "profile ms",
               "profile / whole"]  # fmt: skip
    print(C.markdown(headers, rows))
    C.write_json(args.out, {"machine": C.machine(args.device), "args": vars(args), "cells": cells})


if __name__ == "__main__":
    main()
