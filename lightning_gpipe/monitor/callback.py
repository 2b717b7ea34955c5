"""``PipelineMonitor``: what each stage of a gpipe pipeline did per step, logged per stage, and a timeline trace."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gpipe._lightning import log_to_loggers, should_update_logs
from lightning_gpipe.engine import distributed
from lightning_gpipe.engine.pipe import GPipe
from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.monitor.timeline import write_chrome_trace, write_timeline_png
from lightning_gpipe.monitor.timer import FIELDS, Span, StageTimer, StepRecord, derived, peak_memory_bytes
from lightning_gpipe.strategy import GPipeStrategy

__all__ = ["PipelineMonitor"]

_KINDS = ("forward", "recompute", "backward", "wait", "fill", "drain")
_COLUMNS = ("forward", "recompute", "backward", "wait", "idle", "step", "utilization", "bubble", "peak_memory_mb")


class PipelineMonitor(Callback):
    """Measures every stage of a ``strategy="gpipe"`` run: are the stages balanced, how large is the bubble.

    Per stage and training step it measures forward, recompute, backward, wait (for a message or for
    the delivery of sends) and idle time; utilization (busy over the pipeline's step, its longest
    stage's); the bubble (the share of the pipeline's window, the first stage's fill and drain, the
    stage was not busy) beside GPipe's ``(K - 1) / (M + K - 1)``; and peak memory (CUDA
    max-allocated, or the process's peak RSS on the CPU). At every step Lightning writes logs
    (``log_every_n_steps``) the stages' averages since the last write are gathered (one small
    all-gather) and sent to the Trainer's loggers as
    ``pipeline/stage{k}/<name>`` (times in ms per step), with ``pipeline/bubble`` (also shown in the
    progress bar) and ``pipeline/bubble_theory``; they are also in ``trainer.logged_metrics``. At the
    end of fit rank 0 prints a table per stage and writes the timeline of ``trace_steps`` as a Chrome
    trace (``<filename>.json``, for https://ui.perfetto.dev or chrome://tracing) and, with matplotlib,
    a PNG. The paths are in ``trace_path`` and ``png_path``, the table in ``table``.

    Example::

        trainer = L.Trainer(strategy="gpipe", devices=2, callbacks=[PipelineMonitor(trace_steps=[3])])

    Args:
        trace_steps: the training batches to draw, counted from 0 in each ``fit``; the first pays
            one-off setup costs (connections, allocations), so the default draws the second.
        dirpath: where the trace goes; by default the logger's ``log_dir``, else ``default_root_dir``.
        filename: the trace files' name without extension.
    """

    def __init__(
        self, trace_steps: Sequence[int] = (1,), dirpath: Optional[str] = None, filename: str = "pipeline_trace"
    ) -> None:
        if isinstance(trace_steps, int) or not all(isinstance(s, int) and s >= 0 for s in trace_steps):
            raise ValueError(
                f"`trace_steps` must be a list of training-batch indices >= 0, such as [1, 2], got {trace_steps!r}."
            )
        if not filename or os.sep in filename:
            raise ValueError(f"`filename` must be a file name without directory or extension, got {filename!r}.")
        self.trace_steps, self.dirpath, self.filename = frozenset(trace_steps), dirpath, filename
        self.trace_path: Optional[str] = None
        self.png_path: Optional[str] = None
        self.table = ""
        self.summary: dict[int, dict[str, float]] = {}
        self._timer: Optional[StageTimer] = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and not isinstance(trainer.strategy, GPipeStrategy):
            raise ValueError(
                f"PipelineMonitor measures a gpipe pipeline, but the Trainer's strategy is "
                f"{type(trainer.strategy).__name__}; use Trainer(strategy='gpipe', ...)."
            )

    def _pipe(self, trainer: "pl.Trainer") -> GPipe:
        pipe = getattr(trainer.strategy, "pipe", None)
        assert isinstance(pipe, GPipe), "the gpipe strategy builds its pipe in setup, before on_fit_start"
        return pipe

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        pipe = self._pipe(trainer)
        self._timer = StageTimer(pipe.device)
        pipe.tracer = self._timer
        self._batches = 0
        self._interval = [0.0] * (len(FIELDS) + 1)  # sums of FIELDS, then the number of steps
        self._fit = [0.0] * (len(FIELDS) + 1)  # the same from the second step on
        self._first = [0.0] * (len(FIELDS) + 1)
        self._traced: list[StepRecord] = []
        self.trace_path = self.png_path = None
        self.table, self.summary = "", {}

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        assert self._timer is not None
        self._timer.begin_step(self._batches)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._timer is not None
        self._timer.end_step()
        self._batches += 1
        self._absorb(self._timer.collect())
        if should_update_logs(trainer):
            per_stage, bubble = self._gather(trainer, self._interval)
            self._interval = [0.0] * len(self._interval)
            self._log(trainer, pl_module, per_stage, bubble)

    def _absorb(self, records: list[StepRecord]) -> None:
        for record in records:
            totals = record.totals()
            values = [*(totals[f] for f in FIELDS), 1.0]
            for acc in (self._interval, self._fit if record.step > 0 else self._first):
                for j, v in enumerate(values):
                    acc[j] += v
            if record.step in self.trace_steps:
                self._traced.append(record)

    def _gather(self, trainer: "pl.Trainer", sums: list[float]) -> tuple[dict[int, dict[str, float]], float]:
        """Every stage's per-step averages (replicas of a stage pooled), and the pipeline's bubble; collective.

        Gathers from every rank: the strategy's collectives, for user code, run over the replicas of one stage.
        """
        pipe = self._pipe(trainer)
        mine = torch.tensor(
            [*sums, peak_memory_bytes(pipe.device)], dtype=torch.float64, device=trainer.strategy.root_device
        )
        rows = (
            distributed.all_gather(mine, watch=self._pipe(trainer).watch("PipelineMonitor's gather"))
            .reshape(-1, mine.numel())
            .cpu()
        )  # one small tensor, rank order
        stages = pipe.layout.pipe_size
        pooled = torch.zeros(stages, mine.numel(), dtype=torch.float64)
        for rank, row in enumerate(rows):
            stage = pipe.layout.stage_of(rank)
            pooled[stage, :-1] += row[:-1]
            pooled[stage, -1] = max(pooled[stage, -1].item(), row[-1].item())
        per_stage: dict[int, dict[str, float]] = {}
        counts = pooled[:, len(FIELDS)]
        if counts[0] == 0:  # on a GPU, no step of the first stage had completed yet: no window to measure against
            return per_stage, math.nan
        window = pooled[0, FIELDS.index("window")].item() / counts[0].item()  # the pipeline's: the first stage's
        steps = [row[FIELDS.index("step")].item() / row[len(FIELDS)].item() for row in pooled if row[len(FIELDS)] > 0]
        step = max(steps)  # the pipeline's step: its longest stage's (see `derived`)
        busy = 0.0
        for stage, row in enumerate(pooled.tolist()):
            count = row[len(FIELDS)]
            if count == 0:
                continue
            totals = {f: row[j] / count for j, f in enumerate(FIELDS)}
            busy += totals["forward"] + totals["recompute"] + totals["backward"]
            values = {k: v * 1e3 for k, v in totals.items() if k != "window"}  # seconds -> ms per step
            extra = derived(totals, window, step)
            values.update(
                idle=extra["idle"] * 1e3,
                utilization=extra["utilization"],
                bubble=extra["bubble"],
                peak_memory_mb=row[-1] / 2**20,
            )
            per_stage[stage] = values
        return per_stage, (max(1.0 - busy / (stages * window), 0.0) if window > 0 else math.nan)

    def _log(
        self,
        trainer: "pl.Trainer",
        pl_module: "pl.LightningModule",
        per_stage: dict[int, dict[str, float]],
        bubble: float,
    ) -> None:
        names = {
            "forward": "forward_ms",
            "recompute": "recompute_ms",
            "backward": "backward_ms",
            "wait": "wait_ms",
            "idle": "idle_ms",
            "step": "step_ms",
        }
        metrics = {
            f"pipeline/stage{stage}/{names.get(k, k)}": v
            for stage, values in per_stage.items()
            for k, v in values.items()
            if not math.isnan(v)
        }
        pipe = self._pipe(trainer)
        metrics["pipeline/bubble_theory"] = bubble_fraction(pipe.chunks, pipe.layout.pipe_size)
        if not math.isnan(bubble):
            metrics["pipeline/bubble"] = bubble
            # the progress bar only: the loggers get it below, with the rest
            pl_module.log("pipeline/bubble", bubble, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        log_to_loggers(trainer, metrics)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self._timer is not None
        self._absorb(self._timer.collect(wait=True))
        pipe = self._pipe(trainer)
        pipe.tracer = None
        fit = self._fit if self._fit[len(FIELDS)] > 0 else self._first  # a one-step fit has only the first
        self.summary, bubble = self._gather(trainer, fit)
        rows = self._gather_traces(trainer)
        directory = self.dirpath or trainer.log_dir or trainer.default_root_dir  # log_dir is collective
        if not trainer.is_global_zero:
            return
        self.table = _table(self.summary, bubble, pipe, first_only=fit is self._first)
        rank_zero_info(self.table)
        ran = sorted(step for step in self.trace_steps if step < self._batches)
        missed = sorted(self.trace_steps.difference(ran))
        if missed:
            rank_zero_warn(
                f"PipelineMonitor(trace_steps={sorted(self.trace_steps)}): the fit ran {self._batches} training "
                f"batches (0 to {self._batches - 1}), so batch{'es' * (len(missed) > 1)} {missed} never ran and "
                + ("nothing was traced: no trace file was written" if not rows else "the trace holds the others")
                + ". Give trace_steps below the number of training batches of the fit."
            )
        if rows:
            meta = {
                "stages": pipe.layout.pipe_size,
                "chunks": pipe.chunks,
                "checkpoint": pipe.checkpoint,
                "steps": ran,
            }
            self.trace_path = write_chrome_trace(os.path.join(directory, self.filename + ".json"), rows, meta)
            title = f"{pipe.layout.pipe_size} stages, {pipe.chunks} micro-batches, checkpoint={pipe.checkpoint!r}"
            self.png_path = write_timeline_png(os.path.join(directory, self.filename + ".png"), rows, title)

    def _gather_traces(self, trainer: "pl.Trainer") -> dict[tuple[int, int], list[StepRecord]]:
        """Every rank's traced steps, keyed by (replica, stage); collective (two small all-gathers)."""
        encoded = [[r.step, -1.0, -1.0, r.start, r.end] for r in self._traced]
        encoded += [
            [r.step, float(_KINDS.index(s.kind)), s.micro, s.start, s.end] for r in self._traced for s in r.spans
        ]
        device = trainer.strategy.root_device
        mine = torch.tensor(encoded, dtype=torch.float64, device=device).reshape(-1, 5)
        counts = (
            distributed.all_gather(
                torch.tensor([len(encoded)], device=device), watch=self._pipe(trainer).watch("PipelineMonitor's gather")
            )
            .reshape(-1)
            .tolist()
        )
        if max(counts) == 0:  # every rank sees the same counts, so every rank skips the gather
            return {}
        padded = torch.zeros(max(counts), 5, dtype=torch.float64, device=device)
        padded[: len(encoded)] = mine
        gathered = (
            distributed.all_gather(padded, watch=self._pipe(trainer).watch("PipelineMonitor's gather"))
            .reshape(len(counts), -1, 5)
            .cpu()
        )
        layout = self._pipe(trainer).layout
        rows: dict[tuple[int, int], list[StepRecord]] = {}
        for rank, (count, block) in enumerate(zip(counts, gathered)):
            steps: dict[int, StepRecord] = {}
            for step, kind, micro, start, end in block[:count].tolist():
                if kind < 0:
                    steps[int(step)] = StepRecord(int(step), start, end, [])
                else:
                    steps[int(step)].spans.append(Span(_KINDS[int(kind)], int(micro), start, end))
            if steps:
                rows[(layout.replica_of(rank), layout.stage_of(rank))] = [steps[s] for s in sorted(steps)]
        return rows

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        pipe = getattr(trainer.strategy, "pipe", None)
        if isinstance(pipe, GPipe):
            pipe.tracer = None  # no collectives here: the other ranks may be gone


def _table(summary: dict[int, dict[str, float]], bubble: float, pipe: GPipe, first_only: bool) -> str:
    """The compact per-stage table printed at the end of fit."""
    stages, chunks = pipe.layout.pipe_size, pipe.chunks
    which = "the only step" if first_only else "steps after the first"
    lines = [
        f"PipelineMonitor: {stages} stages x {chunks} micro-batches (checkpoint={pipe.checkpoint!r}), "
        f"mean per step over {which}",
        "| stage | forward ms | recompute ms | backward ms | wait ms | idle ms | step ms | utilization | bubble "
        "| peak MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for stage in sorted(summary):
        values = summary[stage]
        cells = [
            f"{values[c]:.1f}"
            if c in ("peak_memory_mb",)
            else f"{values[c]:.3f}"
            if c in ("utilization", "bubble")
            else f"{values[c]:.2f}"
            for c in _COLUMNS
        ]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append(f"bubble: measured {bubble:.3f}, theory (K-1)/(M+K-1) = {bubble_fraction(chunks, stages):.3f}")
    return "\n".join(lines)
