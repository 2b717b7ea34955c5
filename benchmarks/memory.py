"""Memory: peak memory per stage by checkpoint mode and K, and the largest AmoebaNet that trains under a cap.

    python benchmarks/memory.py                          # CPU here: K = 1, 2, 4
    python benchmarks/memory.py --cap-mib 512 --stages 1 2 4
    python benchmarks/memory.py --models unet            # the U-Net: its B (units per level) grows instead of L

Two tables, both from real training steps (Adam, so parameters, gradients and two optimizer states
per parameter):

1. Peak memory of every stage of AmoebaNet-D for each checkpoint mode and each K, with M
   micro-batches, and the fastest step of the cell (the slowest rank's). A stage's peak is what it
   holds at its worst moment: its parameters, gradients and optimizer state, the activations it
   keeps between the fill and the drain, and what a pass needs while it runs. ``keep:N``
   (checkpointing by count, ``--keep``) sits between ``never`` and ``except_last``.
2. The shape of GPipe's Table 1: the most normal cells L (at a fixed width D) that train under a
   per-process cap, for naive-1 (one process, M=1, no re-materialization), pipeline-1 (one process,
   M micro-batches, ``checkpoint="always"``) and pipeline-K. The search measures two small models,
   extrapolates the peak linearly in L, then trains the predicted size and its neighbours until the
   boundary is found: the reported L trained under the cap, and L+3 did not. These models are
   smaller per sample (``--largest-image``, ``--largest-batch``) so that the search stays quick.
   With ``--models unet`` both tables are the U-Net's, and table 2 grows its convolution units per
   level B at a fixed C (``--largest-unet-channels``), as torchgpipe's U-Net memory benchmark does.

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
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import _common as C
import torch
import torch.distributed as dist

from lightning_gpipe.engine.host_malloc import MMAP_THRESHOLD, TRIM_THRESHOLD, set_thresholds

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


_MEMORY_MMAP = 256 * 1024


def malloc_for(purpose: str) -> None:
    """Set glibc's malloc for measuring ``"memory"`` or ``"time"`` on the CPU (nothing elsewhere).

    Memory: blocks of 256 KiB and more are mapped and unmapped on each allocation, so freed activations
    leave the resident set and its peak follows the live tensors. That costs page faults on every
    allocation (measured: AmoebaNet-D (6, 32)'s step at a micro-batch of 32 took 2.7 times as long), so
    time is measured under the thresholds a pipeline stage on the CPU runs with by default
    (``GPipeStrategy(reuse_freed_memory=True)``, :mod:`lightning_gpipe.engine.host_malloc`): large blocks
    reused from the heap, whose free top is never trimmed. (Until 2026-11-26 the trim threshold here was
    64 MiB: a K=2, M=1 step of AmoebaNet-D (6, 32) then freed more than that at once, and stage 0 faulted
    about 350 MiB back in every step, 89,000 page faults and 0.2 s of kernel time, which the engine's own
    setting does not pay.)
    """
    mmap, trim = (_MEMORY_MMAP, _MEMORY_MMAP // 2) if purpose == "memory" else (MMAP_THRESHOLD, TRIM_THRESHOLD)
    set_thresholds(mmap, trim)  # does nothing off glibc, as before


def time_then_peak(
    step: Callable[[], Any], device: torch.device, warmup: int, steps: int, memory_steps: int = 2
) -> tuple[list[float], int]:
    """Seconds of ``steps`` training steps after ``warmup`` (malloc set for time), then the peak resident bytes
    (or GPU bytes allocated) over ``memory_steps`` more (malloc set for memory): each read as it is read best."""
    malloc_for("time")
    for _ in range(warmup):  # the first step creates the gradients and the optimizer state
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        C.synchronize(device)
        times.append(time.perf_counter() - start)
    malloc_for("memory")
    _release()
    reset_peak(device)
    for _ in range(memory_steps):
        step()
    C.synchronize(device)
    return times, peak(device)


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
    steps: int = 1,
) -> dict[str, Any]:
    """This stage's peak bytes over 2 training steps (Adam), above what the process held before, and the fastest
    of ``steps`` steps before those (see :func:`time_then_peak`)."""
    malloc_for("memory")
    _release()
    before = resident(device)
    pipe, step = C.gpipe_step(workload, chunks, checkpoint, batch_size, device, split, adam)
    times, top = time_then_peak(step, device, warmup=1, steps=steps)
    measured = {"peak": top - before, "params": sum(p.numel() for p in pipe.parameters()), "step_s": min(times)}
    pipe.close()
    del pipe, step
    _release()
    return measured


def worst_stage(measured: dict[str, Any]) -> dict[str, Any]:
    """Over every rank: the largest peak, the parameters of the whole model, the slowest rank's step."""
    every: list[Optional[dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, measured)
    return {
        "peak": max(m["peak"] for m in every),
        "peaks": [m["peak"] for m in every],
        "params": sum(m["params"] for m in every),
        "step_s": max(m["step_s"] for m in every),
    }


@dataclass(frozen=True)
class Family:
    """A model grown along one size for table 2: AmoebaNet-D by its normal cells L (multiples of 3, at width
    ``--largest-filters``), the U-Net by its convolution units per level B (at ``--largest-unet-channels``)."""

    size: str  # the grown size's key in the rows: "layers" (L) or "convs" (B)
    label: str  # how the tables name it
    smallest: int
    step: int
    limit: int
    workload: Callable[[int], C.Workload]


def family(model: str, args: argparse.Namespace) -> Family:
    if model == "unet":
        return Family(
            "convs",
            "B",
            1,
            1,
            args.max_convs,
            lambda b: C.unet_workload(args.unet_depth, b, args.largest_unet_channels, args.largest_image),
        )
    return Family(
        "layers",
        "L",
        3,
        3,
        args.max_layers,
        lambda layers: C.amoebanet_workload(layers, args.largest_filters, args.largest_image),
    )


def by_mode_worker(rank: int, world: int, args: argparse.Namespace, model: str) -> list[dict]:
    device = C.device_for(rank, args.device)
    C.init_group(device)
    (workload,) = C.workloads([model], args)
    split = C.pipeline_balance(workload, world, args.batch_size // args.chunks, device, cost="memory")
    stage_peak(workload, args.chunks, "never", args.batch_size, device, split)  # once-per-process runtime state
    rows = []
    for mode in modes(args):
        worst = worst_stage(stage_peak(workload, args.chunks, mode, args.batch_size, device, split, args.steps))
        rows.append(
            {"model": model, "stages": world, "checkpoint": mode, "chunks": args.chunks, "balance": split, **worst}
        )
    return rows


def modes(args: argparse.Namespace) -> list[str]:
    """The checkpoint modes of table 1: ``keep:N`` (checkpointing by count) between ``never`` and ``except_last``."""
    keep = [f"keep:{n}" for n in args.keep if 1 < n < args.chunks]
    return ["never", *keep, "except_last", "always"]


def largest_worker(rank: int, world: int, args: argparse.Namespace, chunks: int, checkpoint: str, model: str) -> dict:
    """The largest size of the model's family (see :class:`Family`) whose every stage trains under ``--cap-mib``."""
    device = C.device_for(rank, args.device)
    C.init_group(device)
    grown = family(model, args)
    cap = args.cap_mib * MIB
    tried: dict[int, dict[str, Any]] = {}

    def attempt(size: int) -> dict[str, Any]:
        if size not in tried:
            workload = grown.workload(size)
            split = C.pipeline_balance(workload, world, args.largest_batch // chunks, device, cost="memory")
            tried[size] = worst_stage(stage_peak(workload, chunks, checkpoint, args.largest_batch, device, split))
            tried[size].update({grown.size: size, "fits": tried[size]["peak"] <= cap})
        return tried[size]

    first, second = grown.smallest, grown.smallest + 2 * grown.step
    attempt(first)  # the first training step of a process allocates runtime state once: keep it out of the fit
    tried.clear()
    small, larger = attempt(first), attempt(second)
    per_step = max((larger["peak"] - small["peak"]) / 2, 1.0)  # the peak grows about linearly in the size
    predicted = first + grown.step * (cap - small["peak"]) / per_step
    size = min(max(first, first + grown.step * int((predicted - first) // grown.step)), grown.limit)
    while attempt(size)["fits"] and size < grown.limit:  # walk up to the boundary ...
        size += grown.step
    while not attempt(size)["fits"] and size > first:  # ... and down to the last size that fits
        size -= grown.step
    best = attempt(size)
    return {
        "model": model,
        "stages": world,
        "chunks": chunks,
        "checkpoint": checkpoint,
        "filters": args.largest_unet_channels if model == "unet" else args.largest_filters,
        "best": best if best["fits"] else None,
        "next": tried.get(size + grown.step),
        "tried": sorted(tried.values(), key=lambda t: t[grown.size]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=C.default_device())
    parser.add_argument("--models", nargs="+", default=["amoebanet"], choices=["amoebanet", "unet"])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunks", type=int, default=8, help="M for the pipelines")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--keep", type=int, nargs="*", default=[4], help="the N of the keep:N rows of table 1")
    parser.add_argument("--steps", type=int, default=4, help="training steps per table 1 cell (peak over all)")
    parser.add_argument("--skip-largest", action="store_true", help="table 1 only")
    parser.add_argument("--cap-mib", type=float, default=256.0, help="per-process memory cap for table 2")
    parser.add_argument("--largest-filters", type=int, default=48, help="AmoebaNet-D D of the models in table 2")
    parser.add_argument("--largest-unet-channels", type=int, default=8, help="U-Net C of the models in table 2")
    parser.add_argument("--largest-image", type=int, default=16, help="image side in table 2")
    parser.add_argument("--largest-batch", type=int, default=16, help="batch in table 2")
    parser.add_argument("--largest-chunks", type=int, default=4, help="M of pipeline-K in table 2")
    parser.add_argument("--max-layers", type=int, default=150, help="stop the search for AmoebaNet-D's L here")
    parser.add_argument("--max-convs", type=int, default=64, help="stop the search for the U-Net's B here")
    parser.add_argument("--out", default=C.default_out("memory"))
    C.add_workload_arguments(parser)
    args = parser.parse_args()
    if args.device == "cuda" and max(args.stages) > torch.cuda.device_count():
        parser.error(f"--stages {max(args.stages)} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))  # the launched processes inherit it

    by_mode, largest = [], []
    for model in args.models:
        by_mode += [row for k in args.stages for row in C.launch(by_mode_worker, k, args, model)[0]]
        if args.skip_largest:
            continue
        largest.append(C.launch(largest_worker, 1, args, 1, "never", model)[0])
        largest += [C.launch(largest_worker, k, args, args.largest_chunks, "always", model)[0] for k in args.stages]

    info = C.machine(args.device)
    where = "GPU max allocated" if args.device == "cuda" else "peak resident set above the process baseline"
    for model in args.models:
        print_tables(
            model,
            [r for r in by_mode if r["model"] == model],
            [r for r in largest if r["model"] == model],
            args,
            where,
            C.describe_machine(info),
        )
    C.write_json(args.out, {"machine": info, "args": vars(args), "by_mode": by_mode, "largest": largest})


def print_tables(
    model: str, by_mode: list[dict], largest: list[dict], args: argparse.Namespace, where: str, machine: str
) -> None:
    """Table 1 (peak by checkpoint mode and K) and table 2 (the largest model under the cap) of one model."""
    (workload,) = C.workloads([model], args)
    print(
        f"\nPeak memory per stage ({where}), {workload.describe}, batch {args.batch_size}, M={args.chunks}, Adam\n"
        f"{machine}\n"
    )
    never = {r["stages"]: r for r in by_mode if r["checkpoint"] == "never"}
    print(
        C.markdown(
            ["K", "checkpoint", "largest stage MiB", "every stage MiB", "vs never", "step ms", "vs never"],
            [
                [
                    r["stages"],
                    r["checkpoint"],
                    f"{r['peak'] / MIB:.1f}",
                    " / ".join(f"{p / MIB:.1f}" for p in r["peaks"]),
                    f"{r['peak'] / never[r['stages']]['peak']:.2f}",
                    f"{r['step_s'] * 1e3:.1f}",
                    f"{r['step_s'] / never[r['stages']]['step_s']:.2f}",
                ]
                for r in by_mode
            ],
        )
    )
    if not largest:
        return
    grown = family(model, args)
    if model == "unet":
        name = f"U-Net (B, {args.largest_unet_channels}) of depth {args.unet_depth}"
        legend = "B: convolution units per level; the next size up (B+1)"
    else:
        name = f"AmoebaNet-D (L, {args.largest_filters})"
        legend = "L: normal cells (a multiple of 3); the next size up (L+3)"
    print(
        f"\nThe largest {name} that trains under {args.cap_mib:.0f} MiB per process "
        f"({args.largest_image}x{args.largest_image}, batch {args.largest_batch}, Adam)\n"
    )
    rows = []
    naive = largest[0]["best"]
    for row in largest:
        title = "naive-1" if row["chunks"] == 1 else f"pipeline-{row['stages']}"
        best = row["best"]
        if best is None:
            rows.append([title, row["stages"], row["chunks"], row["checkpoint"], "none fits", "", "", ""])
            continue
        rows.append(
            [
                title,
                row["stages"],
                row["chunks"],
                row["checkpoint"],
                best[grown.size],
                f"{best['params'] / 1e6:.2f}M",
                f"{best['peak'] / MIB:.0f}",
                f"{best['params'] / naive['params']:.2f}x" if naive else "",
            ]
        )
    headers = ["", "K", "M", "checkpoint", f"largest {grown.label}", "parameters", "largest stage MiB"]
    print(C.markdown([*headers, "parameters / naive-1"], rows))
    print(f"\n{legend} exceeded the cap or the search limit.")


if __name__ == "__main__":
    main()
