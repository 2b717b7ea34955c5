"""Runs with batches smaller than `chunks`: every K-stage configuration in one spawn, and one-device references.

Each run is the same Lightning training with ``strategy`` either a ``GPipeStrategy`` (inside a worker of
``lightning_gpipe.launch``) or ``"auto"`` on one device without this package. ``chunks`` is 4 throughout,
so the batches of 1, 2 and 3 samples here have fewer micro-batches than ``chunks``.
"""

from __future__ import annotations

from typing import Any

import _models as M
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CHUNKS = 4


class Recorder(M.Net):
    """``_models.Net`` that keeps every validation and test loss, per batch, and the predictions."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_losses: list[float] = []
        self.test_losses: list[float] = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.cross_entropy(self(x), y).item())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_losses.append(F.cross_entropy(self(x), y).item())


class BNRecorder(Recorder):
    """A backbone with BatchNorm1d over (N, C, L) inputs, so that one sample still has several values per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(M.FEATURES, 16),
            nn.Unflatten(1, (4, 4)),
            nn.BatchNorm1d(4),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(16, 8),
        )


def loader(samples: int, batch_size: int) -> DataLoader:
    return M.loader(batch_size=batch_size, shuffle=False, samples=samples)


def tiled_loader() -> DataLoader:
    """Batches [a, a, a, a], [b, b, b, b], [c, c]: every micro-batch (one sample, chunks=4) equals its batch's sample.

    Normalizing per micro-batch then gives the one-device forward, so what DeferredBatchNorm adds (running
    statistics over the batch, moved once per batch, also for the short last batch) can be compared exactly.
    """
    x, y = M.dataset(samples=3).tensors
    repeats = torch.tensor([4, 4, 2])
    return DataLoader(TensorDataset(x.repeat_interleave(repeats, 0), y.repeat_interleave(repeats)), batch_size=4)


def strategy_for(devices: int, **kwargs: Any) -> Any:
    if devices == 1:
        return "auto"
    from lightning_gpipe import GPipeStrategy

    return GPipeStrategy(chunks=CHUNKS, **kwargs)


def _weights(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def short_batches_everywhere(devices: int) -> dict[str, Any]:
    """2 epochs of 10 samples in batches of 4 (4, 4, 2), validating in batches of 1 (sanity check included),
    then testing in batches of 2 (2, 2, 1) and predicting in batches of 1."""
    L.seed_everything(0, verbose=False)
    model = Recorder()
    kwargs = M.trainer_kwargs(max_steps=-1, max_epochs=2, num_sanity_val_steps=2, limit_val_batches=3)
    trainer = L.Trainer(strategy=strategy_for(devices), devices=devices, **kwargs)
    trainer.fit(model, loader(10, 4), loader(3, 1))
    weights = _weights(model)
    trainer.test(model, loader(5, 2), verbose=False)
    predictions = trainer.predict(model, loader(3, 1))
    assert predictions is not None
    return {
        "losses": list(model.losses),
        "weights": weights,
        "val_losses": list(model.val_losses),
        "test_losses": list(model.test_losses),
        "predictions": [p.detach().cpu() for p in predictions],  # type: ignore[union-attr]
    }


def batches_of_three_and_one(devices: int) -> dict[str, Any]:
    """An epoch of 10 samples in batches of 3 (3, 3, 3, 1), every micro-batch recomputed, Adam."""
    L.seed_everything(0, verbose=False)
    model = Recorder(optimizer="adam")
    trainer = L.Trainer(
        strategy=strategy_for(devices, checkpoint="always"),
        devices=devices,
        **M.trainer_kwargs(max_steps=-1, max_epochs=1),
    )
    trainer.fit(model, loader(10, 3))
    return {"losses": list(model.losses), "weights": _weights(model)}


def deferred_batch_norm_short_batch(devices: int) -> dict[str, Any]:
    """2 epochs of the tiled batches (4, 4, 2) with DeferredBatchNorm in the pipeline, plain BatchNorm on one device."""
    L.seed_everything(0, verbose=False)
    model = BNRecorder()
    kwargs = M.trainer_kwargs(max_steps=-1, max_epochs=2)
    trainer = L.Trainer(strategy=strategy_for(devices, deferred_batch_norm=True), devices=devices, **kwargs)
    trainer.fit(model, tiled_loader())
    return {"losses": list(model.losses), "weights": _weights(model)}


RUNS = {
    "short batches everywhere": short_batches_everywhere,
    "batches of three and one": batches_of_three_and_one,
    "deferred batch norm, short batch": deferred_batch_norm_short_batch,
}


def sweep(rank: int, world_size: int) -> dict[str, Any]:
    return {name: run(world_size) for name, run in RUNS.items()}
