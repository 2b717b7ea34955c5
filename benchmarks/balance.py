"""Benchmark: step time and stage balance of a 2-stage pipeline split uniformly, by parameters and by time.

    python benchmarks/balance.py            # 2 processes (Lightning starts the second one)

The backbone pairs convolutions on 32x32 feature maps (few parameters, much compute) with wide
Linear layers (many parameters, little compute per sample): a convolution takes about ten times a
Linear layer's time with 1/28 of its parameters, so parameter count and time disagree. Each
split trains the same model for a few steps; every process runs one thread, so the 2 stages use the
2 cores. Per split it reports the median step time, the measured max/mean ratio of the stages'
compute time (forward, recompute and backward tasks, from the engine's tracer; 1.0 is perfect),
and the ratio the time profile predicted. The splits run in rotating order over ``--rounds`` rounds,
so that a noisy machine affects them alike. Prints a markdown table, writes
``benchmarks/results/balance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine.partition import stage_costs
from lightning_gpipe.monitor.timer import COMPUTE, StageTimer

WARMUP_STEPS = 3


def backbone() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, 48, 3, padding=1), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Conv2d(48, 48, 3, padding=1), nn.ReLU()]  # 21K parameters, 21M multiply-adds a sample
    layers += [nn.AvgPool2d(8), nn.Flatten()]
    for _ in range(7):
        layers += [nn.Linear(768, 768), nn.ReLU()]  # 590K parameters, 0.6M multiply-adds a sample
    layers.append(nn.Linear(768, 10))
    return nn.Sequential(*layers)


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = backbone()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.backbone(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StageClock(L.Callback):
    """Per step: the wall time; per stage: compute and wait time from a :class:`StageTimer`, gathered at the end."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.balance: list[int] = []
        self.stages: list[dict[str, float]] = []
        self._timer: StageTimer | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        pipe = trainer.strategy.pipe
        self.balance = list(pipe.balance)
        self._timer = StageTimer(pipe.device)
        pipe.tracer = self._timer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= WARMUP_STEPS:
            self._timer.begin_step(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._timer.end_step()

    def on_train_end(self, trainer, pl_module) -> None:
        records = self._timer.collect(wait=True)
        self.steps = [r.end - r.start for r in records]
        totals = [r.totals() for r in records]
        per_step = {
            "compute": sum(t[k] for t in totals for k in COMPUTE) / max(len(records), 1),
            "wait": sum(t["wait"] for t in totals) / max(len(records), 1),
        }
        trainer.strategy.pipe.tracer = None
        self.stages = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(self.stages, per_step)


def run(balance: Any, args: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    samples = args.batch_size * (args.steps + WARMUP_STEPS)
    data = TensorDataset(
        torch.randn(samples, 3, 32, 32, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    clock = StageClock()
    strategy = GPipeStrategy(balance=balance, chunks=args.chunks)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=args.steps + WARMUP_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(Net(), DataLoader(data, batch_size=args.batch_size))
    costs = strategy.layer_costs
    return {
        "balance": clock.balance,
        "step_seconds": statistics.median(clock.steps),
        "stages": clock.stages,
        "layer_seconds": costs.time if costs is not None else None,
    }


def ratio(values: list[float]) -> float:
    """max/mean: 1.0 when every stage costs the same."""
    return max(values) / statistics.mean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per split and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "balance.json")
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per stage
    load_before = os.getloadavg()[0]
    layers = len(backbone())
    splits: dict[str, Any] = {"uniform": [(layers + 1) // 2, layers // 2], "params": "params", "time": "time"}
    names = list(splits)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(args.rounds):  # rotate the order, so that drift in the machine's load hits every split
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            runs[name].append(run(splits[name], args))
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0:
        report(args, names, runs, layers, load_before)


def report(
    args: argparse.Namespace, names: list[str], runs: dict[str, list[dict[str, Any]]], layers: int, load_before: float
) -> None:
    """Rank 0: the markdown table and the JSON file."""
    profile = runs["time"][0]["layer_seconds"]  # what the first balance="time" run measured
    model = backbone()
    params = [float(sum(p.numel() for p in layer.parameters())) for layer in model]
    rows = []
    for name in names:
        balances = sorted({tuple(r["balance"]) for r in runs[name]})
        compute = [statistics.mean(r["stages"][s]["compute"] for r in runs[name]) for s in range(2)]
        rows.append(
            {
                "split": name,
                "balance": [list(b) for b in balances],
                "stage_params": [stage_costs(params, b) for b in balances],
                "step_seconds": statistics.median(r["step_seconds"] for r in runs[name]),
                "speedup_vs_uniform": statistics.median(
                    u["step_seconds"] / r["step_seconds"] for u, r in zip(runs["uniform"], runs[name])
                ),
                "stage_compute_seconds": compute,
                "stage_wait_seconds": [statistics.mean(r["stages"][s]["wait"] for r in runs[name]) for s in range(2)],
                "max_mean_measured": ratio(compute),
                "max_mean_predicted": [ratio(stage_costs(profile, b)) for b in balances],
                "runs": runs[name],
            }
        )
    conv = statistics.median(t for t, m in zip(profile, model) if isinstance(m, nn.Conv2d) and m.in_channels == 48)
    linear = statistics.median(t for t, m in zip(profile, model) if isinstance(m, nn.Linear) and m.out_features == 768)
    print(
        f"\nBackbone: {layers} layers. Forward + backward of a micro-batch of {args.batch_size // args.chunks}: "
        f"Conv2d(48, 48, 3) on 32x32 (21K parameters) {conv * 1e3:.2f} ms, Linear(768, 768) (590K parameters) "
        f"{linear * 1e3:.2f} ms (x{conv / linear:.1f}).\nK=2, chunks={args.chunks}, batch {args.batch_size}, "
        f"{args.steps} steps x {args.rounds} rounds per split; load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after (2 cores).\n"
    )
    print(
        "| split | balance | parameters per stage | step time (s) | speed-up vs uniform | stage compute max/mean "
        "(measured) | max/mean (predicted) |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['split']} | {' or '.join(map(str, row['balance']))} | "
            f"{' or '.join('[' + ', '.join(f'{int(p):,}' for p in s) + ']' for s in row['stage_params'])} | "
            f"{row['step_seconds']:.3f} | {row['speedup_vs_uniform']:.2f} | {row['max_mean_measured']:.2f} | "
            f"{' or '.join(f'{p:.2f}' for p in row['max_mean_predicted'])} |"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "load_average": [load_before, os.getloadavg()[0]],
                "layer_seconds": profile,
                "layer_params": params,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
