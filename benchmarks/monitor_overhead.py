"""What PipelineMonitor costs: step time with and without it, and the time spent inside it, in one run.

    python benchmarks/monitor_overhead.py --devices 2 --steps 40 --repeats 3

Lightning launches the processes (strategy "gpipe", one stage each); every process runs the same
sequence of fits, alternating without and with the monitor so that drifts of a shared machine hit
both alike (ABBA order). Three figures per configuration:

- per-step self time: the time spent inside the monitor's per-batch hooks and its tracer calls
  (measured by wrapping them; the stage that spends most counts) over the fit's step time, as CPU
  time of the thread (what the monitor computes) and as wall time (which adds the time blocked in
  the gather waiting for the slowest stage, a wait that the next step's receive would otherwise
  absorb). Ratios within one fit, so they survive a noisy machine; CPU is held to < 3%.
- A/B: mean step time with the monitor over mean step time without it, minus one: the whole cost,
  including what the wrapping cannot see, but as noisy as the machine (repeats vary by ~10% here).
- end of fit: the one-off seconds of ``on_fit_start`` and ``on_train_end`` (gathers, table,
  trace JSON, PNG with matplotlib), paid once per fit, not per step.

Rank 0 prints a markdown table and writes JSON (``--out``, by default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe import GPipeStrategy, PipelineMonitor, StageTimer

PER_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end")
ONE_OFF_HOOKS = ("on_fit_start", "on_train_end")


class Net(L.LightningModule):
    """A small CNN on 16x16 images: a step of tens of milliseconds on one CPU core per stage."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 16, 10),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepClock(Callback):
    """The wall time from one training batch's start to the next one's: everything a step costs."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args) -> None:
        self.starts.append(time.perf_counter())


class TimedMonitor(PipelineMonitor):
    """PipelineMonitor with stopwatches around its hooks and tracer calls (the benchmark's only addition).

    ``per_step`` holds the time of the per-batch hooks and of every tracer call; ``one_off`` the time
    of ``on_fit_start`` and ``on_train_end`` (the end-of-fit gather, table, trace and PNG).
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds = {"per_step": 0.0, "per_step_cpu": 0.0, "one_off": 0.0, "one_off_cpu": 0.0}
        for name in PER_STEP_HOOKS:
            setattr(self, name, self._timed(getattr(self, name), "per_step"))
        for name in ONE_OFF_HOOKS:
            setattr(self, name, self._timed(getattr(self, name), "one_off"))

    def _timed(self, fn, bucket: str):
        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start
                self.seconds[bucket + "_cpu"] += time.thread_time() - cpu

        return wrapper

    def on_fit_start(self, trainer, pl_module) -> None:  # wrapped in __init__, like the other hooks
        super().on_fit_start(trainer, pl_module)
        timer: StageTimer = self._timer  # type: ignore[assignment]
        timer.start = self._timed(timer.start, "per_step")  # type: ignore[method-assign]
        timer.stop = self._timed(timer.stop, "per_step")  # type: ignore[method-assign]


def fit(args, monitored: bool, log_every: int) -> dict:
    torch.manual_seed(0)
    data = TensorDataset(
        torch.randn(args.batch_size * args.steps, 3, 16, 16), torch.randint(0, 10, (args.batch_size * args.steps,))
    )
    clock = StepClock()
    monitor = TimedMonitor(trace_steps=[2], dirpath=args.trace_dir) if monitored else None
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=args.chunks),
        accelerator="cpu",
        devices=args.devices,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=log_every,
        callbacks=[clock] + ([monitor] if monitor else []),
    )
    trainer.fit(Net(args.width), DataLoader(data, batch_size=args.batch_size))
    durations = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
    steps = durations[args.warmup :]
    seconds = monitor.seconds if monitor else {}
    total = sum(durations)
    return {
        "mean_step_s": statistics.fmean(steps),
        "median_step_s": statistics.median(steps),
        "steps": len(steps),
        "self_wall_fraction": seconds.get("per_step", 0.0) / total,
        "self_cpu_fraction": seconds.get("per_step_cpu", 0.0) / total,
        "one_off_s": seconds.get("one_off", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "monitor_overhead.json")
    )
    parser.add_argument("--trace-dir", default=os.path.join(tempfile.gettempdir(), "lightning_gpipe_traces"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for log_every in (50, 1):  # Lightning's default cadence, and a gather every step (the worst case)
        runs: dict[str, list[dict]] = {"plain": [], "monitor": []}
        for repeat in range(args.repeats):  # ABBA order, so that warming up favours neither
            for monitored in (False, True) if repeat % 2 == 0 else (True, False):
                runs["monitor" if monitored else "plain"].append(fit(args, monitored, log_every))
        plain = statistics.median(r["mean_step_s"] for r in runs["plain"])
        watched = statistics.median(r["mean_step_s"] for r in runs["monitor"])
        own = [(r["self_cpu_fraction"], r["self_wall_fraction"], r["one_off_s"]) for r in runs["monitor"]]
        if dist.is_initialized():  # the stage that spends the most in the monitor counts
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, own)
            own = [max(column) for column in zip(*every)]
        results.append(
            {
                "log_every_n_steps": log_every,
                "plain_step_ms": plain * 1e3,
                "monitor_step_ms": watched * 1e3,
                "ab_overhead": watched / plain - 1,
                "self_cpu_fraction": statistics.median(c for c, _, _ in own),
                "self_wall_fraction": statistics.median(w for _, w, _ in own),
                "one_off_s": statistics.median(s for _, _, s in own),
                "runs": runs,
            }
        )
    if not dist.is_initialized() or dist.get_rank() == 0:
        report(args, results)


def report(args, results: list[dict]) -> None:
    """Rank 0: the markdown table and the JSON file."""
    setup = (
        f"K={args.devices} stages, M={args.chunks} micro-batches, CNN width {args.width}, batch "
        f"{args.batch_size}, {args.steps} steps ({args.warmup} warm-up), {args.repeats} repeats, 1 thread/process"
    )
    print(f"\nPipelineMonitor overhead ({setup})\n")
    print(
        "| log_every_n_steps | step ms without | step ms with | A/B overhead | self CPU / step time "
        "| self wall / step time | end-of-fit s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['log_every_n_steps']} | {r['plain_step_ms']:.1f} | {r['monitor_step_ms']:.1f} | "
            f"{100 * r['ab_overhead']:+.1f}% | {100 * r['self_cpu_fraction']:.2f}% | "
            f"{100 * r['self_wall_fraction']:.2f}% | {r['one_off_s']:.2f} |"
        )
    print(
        "\nself CPU: thread CPU time in the monitor's per-batch hooks and tracer calls (the slowest stage); self wall:"
        "\nthe same in wall time, which adds preemption on a shared machine and, when gathering, the wait for the"
        "\nslowest stage at the gather (a wait the next step's receive absorbs otherwise; compare A/B)."
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"setup": setup, "args": vars(args), "results": results}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
