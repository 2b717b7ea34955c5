"""Workers for tests/test_refusals.py: user code that selects layers another stage holds."""

from __future__ import annotations

import _models as M
import lightning as L
import torch

from lightning_gpipe import GPipeStrategy


class IndexedGroups(M.Net):
    """Param groups built from `self.backbone[...]`, as on one device: layer 0 lies on stage 0 only."""

    def __init__(self, select: str) -> None:
        super().__init__()
        self.select = select

    def configure_optimizers(self):
        first = self.backbone[0] if self.select == "index" else self.backbone[:2]
        return torch.optim.SGD([{"params": first.parameters(), "lr": 0.01}, {"params": self.head.parameters()}], lr=0.1)


def indexed_groups(rank: int, world_size: int, select: str) -> None:
    torch.set_num_threads(1)
    trainer = L.Trainer(strategy=GPipeStrategy(balance=[3, 4], chunks=2), devices=world_size, **M.trainer_kwargs())
    trainer.fit(IndexedGroups(select), M.loader())
