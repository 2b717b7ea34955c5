"""Memory: peak memory per stage by checkpoint mode and K, and the largest AmoebaNet that trains under a cap.

    python benchmarks/memory.py                          # CPU here: K = 1, 2, 4
    python benchmarks/memory.py --cap-mib 512 --stages 1 2 4

Two tables, both from real training steps (Adam, so parameters, gradients and two optimizer states
per parameter):

1. Peak memory of every stage of AmoebaNet-D for each checkpoint mode and each K, with M
   micro-batches. A stage's peak is what it holds at its worst moment: its parameters, gradients
   and optimizer state, the activations it keeps between the fill and the drain, and what a pass
   needs while it runs.
2. The shape of GPipe's Table 1: the most normal cells L (at a fixed width D) that train under a
   per-process cap, for naive-1 (one process, M=1, no re-materialization), pipeline-1 (one process,
   M micro-batches, ``checkpoint="always"``) and pipeline-K. The search measures two small models,
   extrapolates the peak linearly in L, then trains the predicted size and its neighbours until the
   boundary is found: the reported L trained under the cap, and L+3 did not. These models are
   smaller per sample (``--largest-image``, ``--largest-batch``) so that the search stays quick.

How memory is read: on a GPU, ``torch.cuda.max_memory_allocated`` after a reset. On the CPU, the
process's peak resident set size (``VmHWM``), reset through ``/proc/self/clear_refs`` once the
stage is built, minus the resident size before the model was built. glibc's malloc is told to
serve large blocks by ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so freed activations leave the
resident set and the peak follows the live tensors. Every rank builds the whole model before the
pipeline frees the other stages' layers (a LightningModule's ``__init__`` does the same); that
transient is outside the measured peak, as it is outside a GPU's memory.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
from typing import Any, Optional

import _common as C
import torch
import torch.distributed as dist

MIB = 2**20


def adam(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=1e-3)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _release() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def resident(device: torch.device) -> int:
    """Bytes in use now: allocated on the GPU, resident on the CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _status("VmRSS")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status("VmHWM")


def stage_peak(
    workload: C.Workload,
    chunks: int,
    checkpoint: str,
    batch_size: int,
    device: torch.device,
    split: list[int],
    steps: int = 2,
) -> dict[str, int]:
    """This stage's peak bytes over ``steps`` training steps (Adam), above what the process held before."""
    _release()
    before = resident(device)
    pipe, step = C.gpipe_step(workload, chunks, checkpoint, batch_size, device, split, adam)
    _release()
    reset_peak(device)
    for _ in range(steps):  # the first step creates the gradients and the optimizer state
        step()
    C.synchronize(device)
    measured = {"peak": peak(device) - before, "params": sum(p.numel() for p in pipe.parameters())}
    pipe.close()
    del pipe, step
    _release()
    return measured


def worst_stage(measured: dict[str, int]) -> dict[str, Any]:
    """Over every rank: the largest peak, and the parameters of the whole model."""
    every: list[Optional[dict[str, int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, measured)
    return {
        "peak": max(m["peak"] for m in every),
        "peaks": [m["peak"] for m in every],
        "params": sum(m["params"] for m in every),
    }


def by_mode_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    device = C.device_for(rank, args.device)
    C.init_group(device)
    workload = C.amoebanet_workload(args.amoebanet_layers, args.amoebanet_filters, args.image)
    split = C.pipeline_balance(workload, world, args.batch_size // args.chunks, device, cost="memory")
    stage_peak(workload, args.chunks, "never", args.batch_size, device, split)  # once-per-process runtime state
    rows = []
    for mode in ("never", "except_last", "always"):
        worst = worst_stage(stage_peak(workload, args.chunks, mode, args.batch_size, device, split))
        rows.append({"stages": world, "checkpoint": mode, "chunks": args.chunks, "balance": split, **worst})
    return rows


def largest_worker(rank: int, world: int, args: argparse.Namespace, chunks: int, checkpoint: str) -> dict:
    """The most normal cells (a multiple of 3) whose every stage trains under ``--cap-mib``."""
    device = C.device_for(rank, args.device)
    C.init_group(device)
    cap = args.cap_mib * MIB
    tried: dict[int, dict[str, Any]] = {}

    def attempt(layers: int) -> dict[str, Any]:
        if layers not in tried:
            workload = C.amoebanet_workload(layers, args.largest_filters, args.largest_image)
            split = C.pipeline_balance(workload, world, args.largest_batch // chunks, device, cost="memory")
            tried[layers] = worst_stage(stage_peak(workload, chunks, checkpoint, args.largest_batch, device, split))
            tried[layers].update(layers=layers, fits=tried[layers]["peak"] <= cap)
        return tried[layers]

    attempt(3)  # the first training step of a process allocates runtime state once: keep it out of the fit
    tried.clear()
    small, larger = attempt(3), attempt(9)
    per_layer = max((larger["peak"] - small["peak"]) / 6, 1.0)
    predicted = 3 + (cap - small["peak"]) / per_layer
    layers = min(max(3, 3 * int(predicted // 3)), args.max_layers)
    while attempt(layers)["fits"] and layers < args.max_layers:  # walk up to the boundary ...
        layers += 3
    while not attempt(layers)["fits"] and layers > 3:  # ... and down to the last size that fits
        layers -= 3
    best = attempt(layers)
    return {
        "stages": world,
        "chunks": chunks,
        "checkpoint": checkpoint,
        "filters": args.largest_filters,
        "best": best if best["fits"] else None,
        "next": tried.get(layers + 3),
        "tried": sorted(tried.values(), key=lambda t: t["layers"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=C.default_device())
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunks", type=int, default=8, help="M for the pipelines")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--cap-mib", type=float, default=256.0, help="per-process memory cap for table 2")
    parser.add_argument("--largest-filters", type=int, default=48, help="D of the models in table 2")
    parser.add_argument("--largest-image", type=int, default=16, help="image side in table 2")
    parser.add_argument("--largest-batch", type=int, default=16, help="batch in table 2")
    parser.add_argument("--largest-chunks", type=int, default=4, help="M of pipeline-K in table 2")
    parser.add_argument("--max-layers", type=int, default=150, help="stop the search for L here")
    parser.add_argument("--out", default=C.default_out("memory"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    if args.device == "cuda" and max(args.stages) > torch.cuda.device_count():
        parser.error(f"--stages {max(args.stages)} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))  # the launched processes inherit it

    by_mode = [row for k in args.stages for row in C.launch(by_mode_worker, k, args)[0]]
    largest = [C.launch(largest_worker, 1, args, 1, "never")[0]]
    largest += [C.launch(largest_worker, k, args, args.largest_chunks, "always")[0] for k in args.stages]

    info = C.machine(args.device)
    where = "GPU max allocated" if args.device == "cuda" else "peak resident set above the process baseline"
    print(
        f"\nPeak memory per stage ({where}), AmoebaNet-D ({args.amoebanet_layers}, {args.amoebanet_filters}), "
        f"{args.image}x{args.image}, batch {args.batch_size}, M={args.chunks}, Adam\n{C.describe_machine(info)}\n"
    )
    never = {r["stages"]: r["peak"] for r in by_mode if r["checkpoint"] == "never"}
    print(
        C.markdown(
            ["K", "checkpoint", "largest stage MiB", "every stage MiB", "vs never"],
            [
                [
                    r["stages"],
                    r["checkpoint"],
                    f"{r['peak'] / MIB:.1f}",
                    " / ".join(f"{p / MIB:.1f}" for p in r["peaks"]),
                    f"{r['peak'] / never[r['stages']]:.2f}",
                ]
                for r in by_mode
            ],
        )
    )
    print(
        f"\nThe largest AmoebaNet-D (L, {args.largest_filters}) that trains under {args.cap_mib:.0f} MiB per process "
        f"({args.largest_image}x{args.largest_image}, batch {args.largest_batch}, Adam)\n"
    )
    rows = []
    naive = largest[0]["best"]
    for row in largest:
        name = "naive-1" if row["chunks"] == 1 else f"pipeline-{row['stages']}"
        best = row["best"]
        if best is None:
            rows.append([name, row["stages"], row["chunks"], row["checkpoint"], "none fits", "", "", ""])
            continue
        rows.append(
            [
                name,
                row["stages"],
                row["chunks"],
                row["checkpoint"],
                best["layers"],
                f"{best['params'] / 1e6:.2f}M",
                f"{best['peak'] / MIB:.0f}",
                f"{best['params'] / naive['params']:.2f}x" if naive else "",
            ]
        )
    print(
        C.markdown(
            ["", "K", "M", "checkpoint", "largest L", "parameters", "largest stage MiB", "parameters / naive-1"], rows
        )
    )
    print("\nL: normal cells (a multiple of 3); the next size up (L+3) exceeded the cap or the search limit.")
    C.write_json(args.out, {"machine": info, "args": vars(args), "by_mode": by_mode, "largest": largest})


if __name__ == "__main__":
    main()
