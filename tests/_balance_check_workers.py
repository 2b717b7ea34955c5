"""Workers for the balance check: a profile that is right, and one that a layer makes wrong on purpose."""

from __future__ import annotations

import time
import warnings

import _models as M
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, SLOW = 32, 2  # layer 2 is the one that turns slow after profiling


class Heavy(nn.Module):
    """A layer of fixed cost (a 2 ms wait per forward) that can be made slower.

    The cost is a sleep, not arithmetic: a sleep lasts as long whether or not the two ranks and the rest of
    the machine compete for its cores, so the profile and the measured steps agree however busy the CI
    machine is, and only the slowdown made on purpose can make a profile wrong.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.slow = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.008 if self.slow else 0.002)
        return torch.tanh(self.lin(x))


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(M.FEATURES, WIDTH), *[Heavy() for _ in range(6)], nn.Linear(WIDTH, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.backbone(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SlowAfterProfiling(Callback):
    """Makes layer ``SLOW`` slow once training starts: after the split was chosen from its profile."""

    def on_train_start(self, trainer, pl_module) -> None:
        for module in pl_module.modules():
            if isinstance(module, Heavy) and getattr(module, "index", None) == SLOW:
                module.slow = True


class RankZeroLogger(Callback):
    """A rank-zero-only callback, as common Lightning code has: the check must not need it on every rank."""

    def __init__(self) -> None:
        self.batches = 0

    @rank_zero_only
    def on_train_batch_end(self, *args) -> None:
        self.batches += 1


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, M.FEATURES, generator=generator)
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (64,), generator=generator)), batch_size=8)


def _fit(balance, slow: bool) -> tuple[dict, dict]:
    from lightning_gpipe import GPipeStrategy

    model = Net()
    for index, layer in enumerate(model.backbone):
        layer.index = index
    callbacks = [RankZeroLogger()] + ([SlowAfterProfiling()] if slow else [])
    strategy = GPipeStrategy(chunks=2, balance=balance)
    trainer = L.Trainer(strategy=strategy, devices=2, callbacks=callbacks, **M.trainer_kwargs(max_steps=7))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _data())
    check = strategy.balance_check
    found = {
        "check": None if check is None else {**vars(check), "message": check.message()},
        "warnings": [str(w.message) for w in caught if "balance check" in str(w.message)],
    }
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if v.device.type != "meta"}
    return found, weights


def balance_checks(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    wrong, _ = _fit("time", slow=True)
    right, weights = _fit("time", slow=False)
    given, given_weights = _fit(right["check"]["balance"], slow=False)  # the same split, given: nothing is checked
    same = all(torch.equal(weights[k], given_weights[k]) for k in weights)
    return {"wrong": wrong, "right": right, "given": given, "same_weights": same}
