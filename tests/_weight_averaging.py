"""Workers for the weight-averaging tests: every averaging run of one K in one spawn, then ModelPruning's refusal.

``fit(run, directory, devices)`` is both sides of a comparison: with ``devices=None`` it is the one-device run
(Lightning's default strategy, no pipeline), otherwise the pipeline inside a spawned rank.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import _models as M
import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, ModelPruning, StochasticWeightAveraging
from torch import nn

EPOCHS = 4


class BatchNormNet(M.Net):
    """A BatchNorm in the backbone's second stage only (balance [2, 4]): SWA adds an epoch that recomputes its
    statistics, which every stage must run, including the first, which holds none."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.backbone = nn.Sequential(
            nn.Linear(M.FEATURES, 16), nn.Tanh(), nn.Linear(16, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 8)
        )


@dataclass(frozen=True)
class Run:
    """One averaging run: the callback, the model, the pipeline's settings and, to resume, the epoch to start from."""

    name: str
    callback: Callable[[], L.Callback]
    model: Callable[[], M.Net] = M.Net
    strategy: dict = field(default_factory=dict)
    resume_from: Optional[str] = None  # a checkpoint file of the run `name` (without " resumed")
    validate: bool = False  # validate every epoch (EMA swaps the average in) and once more after fit


def _swa() -> L.Callback:
    return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2)


def _ema() -> L.Callback:
    return EMAWeightAveraging(decay=0.8)


RUNS = [
    Run("swa", _swa, strategy=dict(chunks=2)),
    Run("ema", _ema, strategy=dict(chunks=3, checkpoint="always"), validate=True),
    # one micro-batch: BatchNorm's statistics then cover the whole batch, as on one device
    Run("swa batchnorm", _swa, model=BatchNormNet, strategy=dict(chunks=1, balance=[2, 4])),
    # weights tied across the stages (layer 6 uses layer 0's weight and layer 2's bias): each holder averages its copy
    Run("ema tied", _ema, model=M.TiedNet, strategy=dict(chunks=2, balance=[3, 4])),
    Run("swa resumed", _swa, strategy=dict(chunks=2), resume_from="epoch=1.ckpt"),
    Run("ema resumed", _ema, strategy=dict(chunks=3, checkpoint="always"), resume_from="epoch=1.ckpt"),
]


def averaged_state(callback: L.Callback) -> dict[str, torch.Tensor]:
    """The callback's averaged model as a state_dict (for EMA the AveragedModel's, with ``n_averaged``)."""
    average: Any = callback._average_model  # type: ignore[attr-defined]
    return {k: v.detach().cpu().clone() for k, v in average.state_dict().items()}


def fit(run: Run, directory: str, devices: Optional[int] = None) -> dict[str, Any]:
    """Train ``run``, saving a checkpoint every epoch under ``directory/<run>``; what the tests compare."""
    L.seed_everything(0, verbose=False)
    model = run.model()
    callback = run.callback()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(directory, run.name), filename="{epoch}", save_top_k=-1)
    kwargs = M.trainer_kwargs(max_steps=-1, max_epochs=EPOCHS, enable_checkpointing=True)
    if run.validate:
        kwargs["limit_val_batches"] = 2
    if devices is None:
        trainer = L.Trainer(devices=1, callbacks=[callback, checkpoints], **kwargs)
    else:
        from lightning_gpipe import GPipeStrategy

        strategy = GPipeStrategy(**run.strategy)
        trainer = L.Trainer(strategy=strategy, devices=devices, callbacks=[callback, checkpoints], **kwargs)
    ckpt_path = None
    if run.resume_from is not None:
        ckpt_path = os.path.join(directory, run.name.removesuffix(" resumed"), run.resume_from)
    validation = M.loader(shuffle=False, samples=16) if run.validate else None
    trainer.fit(model, M.loader(shuffle=False), validation, ckpt_path=ckpt_path)
    record = {
        "tied": M.is_tied(_average_module(callback).backbone) if run.model is M.TiedNet else None,
        "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "average": averaged_state(callback),
        "whole average": _is_whole(callback),
        "losses": list(model.losses),
    }
    if run.validate:  # the last epoch's loss of the averaged weights; then validated again, set up anew
        record["val_loss"] = float(trainer.callback_metrics["val_loss"])
        record["validate after fit"] = trainer.validate(model, validation, verbose=False)[0]["val_loss"]
        record["whole average after validate"] = _is_whole(callback)
    return record


def _average_module(callback: L.Callback) -> Any:
    """The callback's copy of the LightningModule (EMA keeps it inside an AveragedModel)."""
    average: Any = callback._average_model  # type: ignore[attr-defined]
    return average.module if hasattr(average, "n_averaged") else average


def _is_whole(callback: L.Callback) -> bool:
    return type(_average_module(callback).backbone) is nn.Sequential


def sweep(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Every run on this rank (rank 0 writes the checkpoints), then ModelPruning, which must be refused."""
    results: dict[str, Any] = {run.name: fit(run, directory, world_size) for run in RUNS}
    results["fit again"] = fit_again(world_size)
    results["pruning"] = refused_pruning(world_size)
    return results


class MetricNet(M.Net):
    """A torchmetrics metric in the module, which the strategy makes sync over the replicas."""

    def __init__(self) -> None:
        super().__init__()
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=M.CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.accuracy(self(batch[0]), batch[1])
        self.log("train_accuracy", self.accuracy)
        return super().training_step(batch, batch_idx)


def fit_again(devices: Optional[int] = None) -> dict[str, Any]:
    """A fit, then a second fit of the same module with EMA (whose setup deep-copies the module), then a pickle of
    it: after a pipelined fit the module's metric held the replica group, which neither copies nor pickles."""
    L.seed_everything(0, verbose=False)
    model = MetricNet()
    for callbacks in ([], [EMAWeightAveraging(decay=0.8)]):
        if devices is None:
            trainer = L.Trainer(devices=1, callbacks=callbacks, **M.trainer_kwargs(max_steps=3))
        else:
            from lightning_gpipe import GPipeStrategy

            trainer = L.Trainer(
                strategy=GPipeStrategy(chunks=2), devices=devices, callbacks=callbacks, **M.trainer_kwargs(max_steps=3)
            )
        trainer.fit(model, M.loader(shuffle=False))
    pickle.dumps(model)
    return {
        "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "accuracy": float(model.accuracy.compute()),  # synced after fit: over the replicas, not the stages
    }


class CopyDuringFit(L.Callback):
    """Weight averaging that copies the live backbone when the fit starts (a hand-written EMA callback)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.average = torch.optim.swa_utils.AveragedModel(pl_module.backbone)


class CalledAverage(M.Net):
    """An EMA made in ``__init__`` (which the strategy cuts like the pipe) that validation runs during the fit."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = torch.optim.swa_utils.AveragedModel(self.backbone)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.head(self.ema(x)), y))


def average_used_during_fit(rank: int, world_size: int, copied: bool) -> None:
    """A fit that copies the live backbone when it starts (``copied``), or runs an average made in ``__init__`` in
    validation: each ends every rank with an error (a failed rank's process exits)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2),
        devices=world_size,
        callbacks=[CopyDuringFit()] if copied else [],
        **M.trainer_kwargs(max_steps=2, num_sanity_val_steps=1, limit_val_batches=1),
    )
    trainer.fit(M.Net() if copied else CalledAverage(), M.loader(), M.loader())


def refused_pruning(world_size: int) -> dict[str, Any]:
    """ModelPruning's error on this rank, and whether any training step ran before it."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()
    pruning = ModelPruning("l1_unstructured", amount=0.3)
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2), devices=world_size, callbacks=[pruning], **M.trainer_kwargs(max_steps=2)
    )
    try:
        trainer.fit(model, M.loader())
    except ValueError as error:
        return {"error": str(error), "steps": len(model.losses)}
    return {"error": None, "steps": len(model.losses)}
