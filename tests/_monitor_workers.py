"""A short fit with ``PipelineMonitor`` and a CSVLogger in K processes; returns what the monitor produced."""

from __future__ import annotations

import csv
import json
import os
import warnings
from typing import Any

import _models as M
import lightning as L
from lightning.pytorch.loggers import CSVLogger


def monitored_fit(
    rank: int, world_size: int, directory: str, chunks: int, checkpoint: str, trace_steps: list[int]
) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy, PipelineMonitor

    L.seed_everything(0, verbose=False)
    monitor = PipelineMonitor(trace_steps=trace_steps)
    kwargs = M.trainer_kwargs(logger=CSVLogger(directory, name="monitor"), log_every_n_steps=2, max_steps=6)
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=chunks, checkpoint=checkpoint), devices=world_size, callbacks=[monitor], **kwargs
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(M.Net(), M.loader(batch_size=12, samples=72))
    result: dict[str, Any] = {
        "warned": [str(w.message) for w in caught if str(w.message).startswith("PipelineMonitor")],
        "progress_bar": dict(trainer.progress_bar_metrics),
        "logged_metrics": {k: float(v) for k, v in trainer.logged_metrics.items()},
    }
    if rank == 0:
        with open(trainer.logger.experiment.metrics_file_path) as f:
            result["csv"] = list(csv.DictReader(f))
        with open(monitor.trace_path) as f:
            result["trace"] = json.load(f)
        result["png"] = monitor.png_path and os.path.getsize(monitor.png_path)
        result["table"] = monitor.table
        result["summary"] = monitor.summary
    return result
