"""Workers for ``GPipeStrategy(chunks="auto", checkpoint="auto", balance="auto")``: the plan on K processes."""

from __future__ import annotations

import logging
from typing import Any

import _models as M
import _sweeps
import lightning as L
import torch

#: The one-device run that the automatic choice must match (the test model has no randomness: any M matches it).
REFERENCE = _sweeps.Config("auto")


class _Log(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def auto_sweep(rank: int, world_size: int) -> dict[str, Any]:
    """An automatic fit (its record, its choice on this rank, the log), then one under a cap nothing fits."""
    from lightning_gpipe import GPipeStrategy

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    log = _Log()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(log)
    try:
        L.seed_everything(0, verbose=False)
        strategy = GPipeStrategy(chunks="auto", checkpoint="auto", balance="auto")
        trainer = L.Trainer(strategy=strategy, devices=world_size, **M.trainer_kwargs())
        results["auto"] = M.fit_record(M.Net(), trainer, M.loader())
    finally:
        logger.removeHandler(log)
    choice = strategy.auto_choice
    assert choice is not None
    results["choice"] = (strategy.chunks, strategy.checkpoint, choice.balance)
    results["log"] = log.messages
    capped = GPipeStrategy(chunks="auto", checkpoint="auto", max_memory=1000)
    try:
        L.Trainer(strategy=capped, devices=world_size, **M.trainer_kwargs()).fit(M.Net(), M.loader())
        results["capped"] = "no error"
    except Exception as error:
        results["capped"] = f"{type(error).__name__}: {error}"
    return results
