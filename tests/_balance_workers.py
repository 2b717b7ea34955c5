"""What the balance tests run inside the K-process sweep: measured splits, their log, a layer that fails."""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import _models as M
import lightning as L
import torch
from torch import Tensor, nn


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


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(0.005)
        return grad


class _Sleep(nn.Module):
    """5 ms in its forward or in its backward: a layer whose two passes weigh apart, measurably on any machine."""

    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase

    def forward(self, x: Tensor) -> Tensor:
        if self.phase == "forward":
            time.sleep(0.005)
            return x * 1.0
        return _SleepInBackward.apply(x)


class _PhasesApart(M.Net):
    """Three layers heavy in the forward, then three heavy in the backward (as frozen layers before trained ones)."""

    def __init__(self) -> None:
        super().__init__()
        sleeps = [_Sleep("forward") for _ in range(3)] + [_Sleep("backward") for _ in range(3)]
        self.backbone = nn.Sequential(nn.Linear(M.FEATURES, 8), *sleeps, nn.Linear(8, 8))  # the head takes 8


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
    defaults = (("default", M.Net(stem=True)), ("default, no sample", _NoSample()), ("phases apart", _PhasesApart()))
    for name, model in defaults:
        records, chosen = _Records(), _ChosenSplit()
        logger.addHandler(records)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                L.seed_everything(0, verbose=False)
                trainer = L.Trainer(
                    strategy=GPipeStrategy(chunks=2, checkpoint="never" if name == "phases apart" else "except_last"),
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
