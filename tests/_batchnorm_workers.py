"""A BatchNorm model and the K-process runs that test DeferredBatchNorm; imports lightning_gpipe lazily."""

from __future__ import annotations

from typing import Any

import _models as M
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CHUNKS, MICRO = 2, 4  # 2 micro-batches of 4 samples: batches of 8


class BNNet(M.Net):
    """``_models.Net`` with BatchNorm in the backbone, one on each stage of a 2-stage split."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(M.FEATURES, 16),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Linear(16, 12),
            nn.BatchNorm1d(12),
            nn.Tanh(),
            nn.Linear(12, 8),
        )


def tiled_loader() -> DataLoader:
    """Batches made of one micro-batch of distinct samples repeated ``CHUNKS`` times.

    Every micro-batch then has the statistics of its whole batch, so normalizing per micro-batch gives
    the same forward and backward as one-device BatchNorm on the batch: what remains to differ is the
    running statistics, which is what DeferredBatchNorm is about.
    """
    base = M.dataset(samples=5 * MICRO)
    x, y = base.tensors
    xs = torch.cat([x[i : i + MICRO].repeat(CHUNKS, 1) for i in range(0, len(x), MICRO)])
    ys = torch.cat([y[i : i + MICRO].repeat(CHUNKS) for i in range(0, len(y), MICRO)])
    return DataLoader(TensorDataset(xs, ys), batch_size=CHUNKS * MICRO, shuffle=False)


def fit(strategy: Any, devices: int, loader: DataLoader) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = BNNet()
    trainer = L.Trainer(strategy=strategy, devices=devices, **M.trainer_kwargs(max_steps=5))
    return M.fit_record(model, trainer, loader)


def pipelined(devices: int, deferred: bool, tiled: bool) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    strategy = GPipeStrategy(chunks=CHUNKS, deferred_batch_norm=deferred)
    return fit(strategy, devices, tiled_loader() if tiled else M.loader(batch_size=CHUNKS * MICRO))


def sweep(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "tiled deferred": pipelined(world_size, deferred=True, tiled=True),
        "tiled plain": pipelined(world_size, deferred=False, tiled=True),
        "shuffled deferred": pipelined(world_size, deferred=True, tiled=False),
    }


def one_device_plain_batch_norm() -> dict[str, Any]:
    """The tiled training on one device, with Lightning's default strategy and plain BatchNorm."""
    return fit("auto", 1, tiled_loader())
