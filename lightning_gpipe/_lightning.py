"""The few private Lightning helpers this package uses, in one place, so that an upgrade breaks here only."""

from __future__ import annotations

import warnings
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device

__all__ = ["init_process_group", "log_to_loggers", "optimizers_to_device", "should_update_logs",
           "silence_not_resumable_warning"]


def init_process_group(environment: ClusterEnvironment, backend: str, device: torch.device,
                       timeout: timedelta) -> None:
    """Initialize the default process group the way Lightning's DDP does (a no-op when it exists)."""
    kwargs = {"timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device  # type: ignore[assignment]
    _init_dist_connection(environment, backend, **kwargs)


optimizers_to_device = _optimizers_to_device


def silence_not_resumable_warning() -> None:
    """Drop Lightning's warning that a plain DataLoader cannot resume mid-epoch: the strategy resumes it.

    Lightning warns when the loader lacks its stateful-loader protocol, which this package does not use
    (see ``resumable.py``), so the warning is matched by its text.
    """
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended",
                            category=PossibleUserWarning)


def should_update_logs(trainer: "pl.Trainer") -> bool:
    """Whether Lightning writes step metrics to the loggers after this batch.

    Lightning has no public accessor; its own monitors (LearningRateMonitor, DeviceStatsMonitor,
    ThroughputMonitor) read this same private property. It depends only on the loop's progress, so
    every rank gets the same answer, which makes it safe to gate a collective on it.
    """
    return trainer._logger_connector.should_update_logs


def log_to_loggers(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger at the current training step, with the ``epoch`` key that Lightning adds.

    This is the path Lightning's ThroughputMonitor takes. ``LightningModule.log`` costs about half a
    millisecond per key (it builds a result-collection entry), which for tens of per-stage keys would
    cost more than the measurement; the loggers themselves write on rank 0 only.
    """
    trainer._logger_connector.log_metrics(metrics)  # type: ignore[arg-type]
