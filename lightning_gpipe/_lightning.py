"""The few private Lightning helpers this package uses, in one place, so that an upgrade breaks here only."""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device

__all__ = ["init_process_group", "optimizers_to_device"]


def init_process_group(environment: ClusterEnvironment, backend: str, device: torch.device,
                       timeout: timedelta) -> None:
    """Initialize the default process group the way Lightning's DDP does (a no-op when it exists)."""
    kwargs = {"timeout": timeout}
    if device.type == "cuda":
        kwargs["device_id"] = device  # type: ignore[assignment]
    _init_dist_connection(environment, backend, **kwargs)


optimizers_to_device = _optimizers_to_device
