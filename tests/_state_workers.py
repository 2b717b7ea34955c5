"""Per-micro-batch state: BatchNorm's warning, buffers written in forward, tensors at stage boundaries.

The workers run inside ``lightning_gpipe.launch`` (a torchrun environment); they import lightning_gpipe lazily.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import _models as M
import lightning as L
import torch
from torch import nn

#: What the plain-BatchNorm warning says (its first words).
BATCH_NORM_WARNING = "has BatchNorm layers that track running statistics"


class Counter(nn.Module):
    """Counts its training forwards in a buffer: a layer that writes a buffer in its forward."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return x


def spectral_backbone() -> nn.Sequential:
    """Spectral-normalized Linears (power-iteration buffers written in every training forward) and a counter."""
    sn = nn.utils.spectral_norm
    return nn.Sequential(
        sn(nn.Linear(M.FEATURES, 16)),
        nn.Tanh(),
        Counter(),
        sn(nn.Linear(16, 12)),
        nn.Tanh(),
        sn(nn.Linear(12, 8)),
        Counter(),
    )


def recompute_vs_never(devices: int, checkpoint: str) -> dict[str, Any]:
    """5 steps of the spectral-norm backbone, chunks=3 (batches of 8: micro-batches of 3, 3, 2)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()
    model.backbone = spectral_backbone()
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=3, checkpoint=checkpoint, balance=[3, 4]), devices=devices, **M.trainer_kwargs()
    )
    return M.fit_record(model, trainer, M.loader(shuffle=False))


class BNNet(M.Net):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(M.FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 8))


def batch_norm_warnings(devices: int, **strategy: Any) -> list[str]:
    """The plain-BatchNorm warnings one setup and step give on this rank."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=GPipeStrategy(**strategy), devices=devices, **M.trainer_kwargs(max_steps=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BNNet(), M.loader())
    return [str(w.message) for w in caught if BATCH_NORM_WARNING in str(w.message)]


class WithStatistic(nn.Module):
    """Returns its input and a statistic over the batch: ``x.mean()`` (0-dim) or ``x.mean(0, keepdim=True)``."""

    def __init__(self, keepdim: bool) -> None:
        super().__init__()
        self.keepdim = keepdim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x.mean(0, keepdim=True) if self.keepdim else x.mean())


class UseStatistic(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, statistic = pair
        return x - statistic


def statistic_across_boundary(devices: int, stage: int, keepdim: bool) -> None:
    """Training where a batch statistic leaves stage ``stage`` for the next one (chunks=2, batches of 8)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()
    balance = {2: [4, 3], 3: [2, 3, 2]}[devices]
    end = sum(balance[: stage + 1])
    model.backbone.insert(end, UseStatistic())
    model.backbone.insert(end, WithStatistic(keepdim))
    balance[stage] += 1
    balance[stage + 1] += 1
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2, balance=balance), devices=devices, **M.trainer_kwargs())
    trainer.fit(model, M.loader())


def quantization_aware_backbone() -> nn.Sequential:
    """Linear layers prepared for quantization-aware training (fake-quantize modules with observers), 8 features out
    for the head of `M.Net`."""
    import torch.ao.quantization as Q

    model = nn.Sequential(nn.Linear(M.FEATURES, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    model.qconfig = Q.get_default_qat_qconfig("x86")
    return Q.prepare_qat(model)


def quantization_aware(devices: Any, chunks: int, checkpoint: str = "except_last") -> dict[str, Any]:
    """5 steps of the quantization-aware backbone with the default balance (profiled by time): ``devices=None`` is
    one device without this package. The observers' range is a statistic over the batch, so with ``chunks > 1`` the
    per-sample check is off (each micro-batch observes its own range, as GPipe runs BatchNorm)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()
    model.backbone = quantization_aware_backbone()
    if devices is None:
        trainer = L.Trainer(devices=1, **M.trainer_kwargs())
    else:
        strategy = GPipeStrategy(chunks=chunks, checkpoint=checkpoint, check_per_sample=chunks == 1)
        trainer = L.Trainer(strategy=strategy, devices=devices, **M.trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notes
        return M.fit_record(model, trainer, M.loader(shuffle=False))


def sweep(rank: int, world_size: int) -> dict[str, Any]:
    """Everything of the 2-stage tests in one spawn; the failing run last (a failed run ends the process)."""
    results: dict[str, Any] = {
        "always": recompute_vs_never(world_size, "always"),
        "never": recompute_vs_never(world_size, "never"),
        "warnings: plain, chunks=4": batch_norm_warnings(world_size, chunks=4),
        "warnings: deferred, chunks=4": batch_norm_warnings(world_size, chunks=4, deferred_batch_norm=True),
        "warnings: plain, chunks=1": batch_norm_warnings(world_size, chunks=1),
        "quantization-aware, chunks=1": quantization_aware(world_size, chunks=1),
        "quantization-aware, chunks=2, always": quantization_aware(world_size, chunks=2, checkpoint="always"),
        "quantization-aware, chunks=2, never": quantization_aware(world_size, chunks=2, checkpoint="never"),
    }
    start = time.monotonic()
    try:
        statistic_across_boundary(world_size, stage=0, keepdim=True)
    except Exception as error:  # every rank must end its fit with an error, within seconds
        results["boundary"] = (f"{type(error).__name__}: {error}", time.monotonic() - start)
    else:
        results["boundary"] = ("no error", time.monotonic() - start)
    return results


def failing_statistic(rank: int, world_size: int) -> None:
    """A 0-dim statistic leaves the middle stage of three: uncaught, as in a user's script."""
    statistic_across_boundary(world_size, stage=1, keepdim=False)
