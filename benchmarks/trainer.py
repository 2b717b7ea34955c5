"""Through the Trainer: an ordinary conv backbone, pipelined over K processes, against one device on one core.

    python benchmarks/trainer.py                       # K=2, M=8, checkpoint="never", 5 rounds, CPU here
    python benchmarks/trainer.py --balance params time --rounds 3
    python benchmarks/trainer.py --malloc --batch-size 256

The image side must be at least 16 (four 2x2 max-pools).

The backbone is none of the benchmark models: a plain VGG-style stack (conv, batch norm, ReLU, twice per
block, max-pool; 32, 64, 128, 256 channels) with a linear head, on 32x32 images. Its parameters grow
sixteen-fold from the first block to the last while each block's compute stays about the same, so a
split by parameter count and a split by time differ a lot.

Rows: ``Trainer(strategy=GPipeStrategy(chunks=M, checkpoint=..., balance=...), devices=K)`` for the
default balance (and any ``--balance`` given; with ``--malloc`` also the defaults with
``reuse_freed_memory=False``), and ``Trainer(devices=1)`` in one process on one thread (no pipeline, no
micro-batches). Each round runs every variant once, in alternating order, in fresh
processes; the table gives the median over rounds and the spread (min-max). The figure of merit is the
speed-up over one device divided by the ideal ``K*M/(M+K-1)`` of a fill-drain schedule with equal stages.
Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from typing import Any

import _common as C
import torch
from torch import Tensor, nn


def conv_workload(image: int = 32) -> C.Workload:
    """A VGG-style backbone as a flat Sequential (31 layers)."""

    def build() -> nn.Sequential:
        layers: list[nn.Module] = []
        channels = 3
        for width in (32, 64, 128, 256):
            for _ in range(2):
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
                channels = width
            layers.append(nn.MaxPool2d(2))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, C.CLASSES)]
        return nn.Sequential(*layers)

    def batch(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(n)
        return (
            torch.randn(n, 3, image, image, generator=g).to(device),
            torch.randint(0, C.CLASSES, (n,), generator=g).to(device),
        )

    return C.Workload("vgg", f"VGG-style conv stack (32-256 channels), {image}x{image} images", build, batch)


def default_balance() -> Any:
    """``GPipeStrategy``'s default ``balance``, read from its signature so that the row names what ran."""
    from lightning_gpipe import GPipeStrategy

    return inspect.signature(GPipeStrategy).parameters["balance"].default


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """The pipelined rows: the strategy's defaults, each ``--balance`` given, and with ``--malloc`` the
    defaults with ``reuse_freed_memory=False`` (glibc's own malloc thresholds); (label, GPipeStrategy options)."""
    rows = [(f"GPipeStrategy(balance={default_balance()!r})", {})]
    rows += [(f"GPipeStrategy(balance={b!r})", {"balance": b}) for b in args.balance if b != default_balance()]
    if args.malloc:
        rows.append(("GPipeStrategy(reuse_freed_memory=False)", {"reuse_freed_memory": False}))
    return rows


def pipeline_worker(rank: int, world: int, args: argparse.Namespace, index: int) -> list[dict]:
    """One variant in fresh processes: ``reuse_freed_memory`` sets malloc for the rest of a process."""
    from lightning_gpipe import GPipeStrategy

    label, options = variants(args)[index]
    strategy = GPipeStrategy(chunks=args.chunks, checkpoint=args.checkpoint, **options)
    seconds = C.lightning_step_seconds(
        conv_workload(args.image), strategy, world, args.batch_size, torch.device("cpu"), args.warmup, args.steps
    )
    return [{"variant": label, "options": options, "step_s": seconds}]


def single_worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    seconds = C.lightning_step_seconds(
        conv_workload(args.image), "auto", 1, args.batch_size, torch.device("cpu"), args.warmup, args.steps
    )
    return [{"variant": "one device, 1 thread", "balance": None, "step_s": seconds}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2, help="K: stages and processes")
    parser.add_argument("--chunks", type=int, default=8, help="M: micro-batches")
    parser.add_argument("--checkpoint", default="never")
    parser.add_argument("--balance", nargs="*", default=[], help="balances to run beside the default")
    parser.add_argument(
        "--malloc", action="store_true", help="also run the defaults with reuse_freed_memory=False (glibc's own malloc)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=C.default_out("trainer"))
    args = parser.parse_args()

    times: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        runs = [
            *(
                (lambda index=index: C.launch(pipeline_worker, args.stages, args, index)[0])
                for index in range(len(variants(args)))
            ),
            lambda: C.launch(single_worker, 1, args, threads=1)[0],
        ]
        for run in runs if round_ % 2 == 0 else runs[::-1]:
            for row in run():
                times.setdefault(row["variant"], []).append(row["step_s"])

    k, m = args.stages, args.chunks
    ideal = k * m / (m + k - 1)
    single = times.pop("one device, 1 thread")
    rows: list[dict[str, Any]] = []
    for variant, seconds in times.items():
        # the speed-up of each round against the same round's one-device time: rounds share the machine's state
        speedups = [s / p for s, p in zip(single, seconds)]
        rows.append(
            {
                "variant": variant,
                "options": dict(variants(args))[variant],
                "default": variant == variants(args)[0][0],
                "step_ms": [1e3 * s for s in seconds],
                "speedup": speedups,
                "of_ideal_median": statistics.median(speedups) / ideal,
                "of_ideal_min": min(speedups) / ideal,
                "of_ideal_max": max(speedups) / ideal,
            }
        )
    info = C.machine("cpu")
    print(
        f"\nThrough the Trainer, K={k}, M={m}, checkpoint={args.checkpoint!r}, batch {args.batch_size}; "
        f"{args.rounds} interleaved rounds of {args.steps} steps; one device: median "
        f"{1e3 * statistics.median(single):.1f} ms per step\n{C.describe_machine(info)}\n"
        f"{conv_workload(args.image).describe}; ideal speed-up K*M/(M+K-1) = {ideal:.2f}\n"
    )
    print(
        C.markdown(
            ["variant", "step ms (median)", "speed-up over one device (median, min-max)", "of ideal (median, min-max)"],
            [
                [
                    r["variant"] + (" (default)" if r["default"] else ""),
                    f"{statistics.median(r['step_ms']):.1f}",
                    f"{statistics.median(r['speedup']):.2f}x ({min(r['speedup']):.2f}-{max(r['speedup']):.2f})",
                    f"{r['of_ideal_median']:.2f} ({r['of_ideal_min']:.2f}-{r['of_ideal_max']:.2f})",
                ]
                for r in rows
            ],
        )
    )
    C.write_json(
        args.out,
        {"machine": info, "args": vars(args), "ideal": ideal, "single_ms": [1e3 * s for s in single], "rows": rows},
    )


if __name__ == "__main__":
    main()
