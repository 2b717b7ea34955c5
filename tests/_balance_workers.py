"""What the balance tests run inside the K-process sweep: measured splits, their log, a layer that fails."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import _models as M
import lightning as L
from torch import nn


class Broken(nn.Module):
    """A layer that fails whenever it runs, so profiling it fails."""

    def forward(self, x):
        raise RuntimeError("this layer is broken")


class _NoSample(M.Net):
    """Its training_step never calls the backbone before it fails, and it has no `example_input_array`:
    no sample micro-batch can be taken for profiling (a step that needs the optimizers, say)."""

    def training_step(self, batch, batch_idx):
        if self.trainer.optimizers == []:  # at setup, when the split is chosen
            raise RuntimeError("no optimizers yet")
        return super().training_step(batch, batch_idx)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _ChosenSplit(L.Callback):
    def __init__(self) -> None:
        self.balance: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.balance = list(trainer.strategy.pipe.balance)


def measured_balance(devices: int) -> dict[str, Any]:
    """Fit with balance="time" and "memory"; record each rank's split, costs and log, then fail in a profile."""
    from lightning_gpipe import GPipeStrategy

    results: dict[str, Any] = {}
    logger = logging.getLogger("lightning.pytorch")
    for kind in ("time", "memory"):
        records, chosen = _Records(), _ChosenSplit()
        logger.addHandler(records)
        try:
            L.seed_everything(0, verbose=False)
            trainer = L.Trainer(
                strategy=GPipeStrategy(balance=kind, chunks=2),
                devices=devices,
                callbacks=[chosen],
                **M.trainer_kwargs(max_steps=1),
            )
            trainer.fit(M.Net(stem=True), M.loader())
        finally:
            logger.removeHandler(records)
        results[kind] = {"balance": chosen.balance, "costs": trainer.strategy.layer_costs, "log": records.messages}
    for name, model in (("default", M.Net(stem=True)), ("default, no sample", _NoSample())):
        records, chosen = _Records(), _ChosenSplit()
        logger.addHandler(records)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                L.seed_everything(0, verbose=False)
                trainer = L.Trainer(
                    strategy=GPipeStrategy(chunks=2),
                    devices=devices,
                    callbacks=[chosen],
                    **M.trainer_kwargs(max_steps=1),
                )
                trainer.fit(model, M.loader())
        finally:
            logger.removeHandler(records)
        results[name] = {
            "balance": chosen.balance,
            "costs": trainer.strategy.layer_costs,
            "log": records.messages,
            "warnings": [str(w.message) for w in caught],
        }
    model = M.Net()
    model.backbone.insert(3, Broken())
    trainer = L.Trainer(
        strategy=GPipeStrategy(balance="time", chunks=2), devices=devices, **M.trainer_kwargs(max_steps=1)
    )
    try:
        trainer.fit(model, M.loader())
        results["failing layer"] = "no error"
    except Exception as error:
        results["failing layer"] = f"{type(error).__name__}: {error}"
    return results
