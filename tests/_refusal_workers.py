"""Workers for tests/test_refusals.py: user code that selects layers another stage holds."""

from __future__ import annotations

from collections import OrderedDict

import _models as M
import lightning as L
import torch
from torch import nn

from lightning_gpipe import GPipeStrategy


class IndexedInHook(M.Net):
    """Freezes `self.backbone[...]` when training starts, as on one device: layer 0 lies on stage 0 only.

    (In ``configure_optimizers`` selecting layers by position works: see ``tests/_compat_loop.py``.)
    """

    def __init__(self, select: str) -> None:
        super().__init__()
        self.select = select
        if select == "name":  # the layers named in an OrderedDict: `backbone.layer0` as on one device
            self.backbone = nn.Sequential(OrderedDict((f"layer{i}", layer) for i, layer in enumerate(self.backbone)))

    def on_train_start(self) -> None:
        selected = {
            "index": lambda: self.backbone[0],
            "slice": lambda: self.backbone[:2],
            "children": lambda: next(iter(self.backbone.children())),  # by position: the first child
        }
        first = selected.get(self.select, lambda: self.backbone.layer0)()
        first.requires_grad_(False)


def indexed_in_hook(rank: int, world_size: int, select: str) -> None:
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy=GPipeStrategy(balance=[3, 4], chunks=2), devices=world_size, **M.trainer_kwargs())
    trainer.fit(IndexedInHook(select), M.loader())


class SkipsOddSteps(M.Net):
    """Returns None from ``training_step`` on odd batches, after the backbone ran: Lightning's way to skip a step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


class Frozen(M.Net):
    """Every parameter frozen (a model loaded for evaluation, then fitted by mistake): nothing can train."""

    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)


class KeptReference(M.Net):
    """Keeps the backbone in a plain dict (not a submodule) and calls it through that reference."""

    def __init__(self) -> None:
        super().__init__()
        self.nets = {"backbone": self.backbone}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.nets["backbone"](x))


class ShardedOptimizerState(M.Net):
    """torch's ZeroRedundancyOptimizer over ``self.parameters()``, as a DDP script builds it."""

    def configure_optimizers(self):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)


class ChecksItsParameters(M.Net):
    """An optimizer that examines its parameters before ``torch.optim.Optimizer.__init__`` (a device check)."""

    def configure_optimizers(self):
        params = list(self.parameters())
        devices = {p.device.type for p in params}
        if len(devices) > 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(devices)}")
        return torch.optim.SGD(params, lr=0.1)


MODELS = {
    "skipped steps": SkipsOddSteps,
    "frozen": Frozen,
    "kept reference": KeptReference,
    "sharded optimizer state": ShardedOptimizerState,
    "checks its parameters": ChecksItsParameters,
}


def fit(rank: int, world_size: int, model: str) -> None:
    """Fits ``MODELS[model]`` at K = ``world_size``, 2 micro-batches."""
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=world_size, **M.trainer_kwargs())
    trainer.fit(MODELS[model](), M.loader())
