"""Random Lightning runs for `test_random_models.py`: the random Sequentials of `_random_models.py` inside a
LightningModule, under Trainer settings and pipeline settings drawn from a seed."""

from __future__ import annotations

import random
import warnings
from typing import Any, Optional

import _random_models as R
import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def _noise_gradients(seed: int) -> bool:
    """Whether some backbone parameter's gradient is a thousandth of the largest or less on a first batch (a
    LayerNorm of a LayerNorm's output leaves the layers before it almost nothing). Adam divides by the gradient's
    size, so it turns the rounding of such a gradient, which micro-batching changes, into whole steps: 2e-3 apart
    after 16 steps, where SGD stays within 3e-8."""
    model = R.build(seed)
    torch.manual_seed(seed)
    F.cross_entropy(model(torch.randn(8, R.FEATURES)), torch.zeros(8, dtype=torch.long)).backward()
    sizes = [p.grad.abs().max().item() for p in model.parameters() if p.grad is not None]
    return min(sizes) < 1e-3 * max(sizes)


def settings(seed: int) -> dict[str, Any]:
    """The Trainer's and the module's settings of ``seed`` (the same for one device and every K)."""
    rng = random.Random(seed * 13 + 1)
    drawn = {
        "accumulate_grad_batches": rng.choice([1, 1, 2, 3]),
        "gradient_clip_val": rng.choice([None, None, 0.05, 0.5]),
        "gradient_clip_algorithm": rng.choice(["norm", "norm", "value"]),
        "optimizer": rng.choice(["sgd", "adam", "adamw"]),
        "scheduler": rng.choice([None, "step", "cosine"]),
        "samples": rng.randint(20, 60),  # most epochs end with a short batch
        "batch": rng.randint(3, 12),
        "epochs": rng.randint(1, 3),
        "stem": rng.random() < 0.5,
        "head": rng.random() < 0.5,
        "manual": rng.random() < 0.3,
    }
    if _noise_gradients(seed):
        drawn["optimizer"] = "sgd"
    return drawn


def pipeline(seed: int, stages: int) -> Optional[dict[str, Any]]:
    """``chunks``, checkpoint mode and split of ``seed`` for ``stages``; None where the model cannot be split so."""
    case = R.case(seed, stages)
    if case is None:
        return None
    rng = random.Random(seed * 17 + stages)
    balance = rng.choice([None, "params", case["balance"]])  # by time (the default), by parameters, or given
    return {"chunks": rng.randint(1, 4), "checkpoint": case["checkpoint"], "balance": balance}


class Net(L.LightningModule):
    """A random backbone, with a stem and a head outside it where the settings say so."""

    def __init__(self, seed: int, drawn: dict[str, Any]) -> None:
        super().__init__()
        self.drawn = drawn
        self.backbone = R.build(seed)
        torch.manual_seed(seed + 1)
        self.stem = nn.Linear(R.FEATURES, R.FEATURES) if drawn["stem"] else nn.Identity()
        self.head = nn.Linear(R.CLASSES, R.CLASSES) if drawn["head"] else nn.Identity()
        self.automatic_optimization = not drawn["manual"]

    def training_step(self, batch: Any, batch_idx: int) -> Optional[Tensor]:
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(self.stem(x))), y)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.drawn["gradient_clip_val"]:
            self.clip_gradients(optimizer, self.drawn["gradient_clip_val"], self.drawn["gradient_clip_algorithm"])
        optimizer.step()
        return None

    def configure_optimizers(self) -> Any:
        kind = self.drawn["optimizer"]
        if kind == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        elif kind == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.drawn["scheduler"] is None:
            return optimizer
        if self.drawn["scheduler"] == "step":
            scheduler: Any = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
        else:
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(seed: int, strategy: Any, devices: int) -> dict[str, Any]:
    drawn = settings(seed)
    L.seed_everything(seed, verbose=False)
    module = Net(seed, drawn)
    data = torch.Generator().manual_seed(seed)
    x = torch.randn(drawn["samples"], R.FEATURES, generator=data)
    y = torch.randint(0, R.CLASSES, (drawn["samples"],), generator=data)
    loop = {} if drawn["manual"] else {k: drawn[k] for k in drawn if k.startswith(("accumulate", "gradient"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings of small data (few batches, a short last batch)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            max_epochs=drawn["epochs"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **loop,
        )
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=drawn["batch"], shuffle=True))
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "steps": trainer.global_step,
    }


def one_device(rank: int, world_size: int, seeds: list[int]) -> dict[int, dict[str, Any]]:
    torch.set_num_threads(1)
    return {seed: _fit(seed, "auto", 1) for seed in seeds if R.case(seed, 2) is not None}  # one device can train it


def pipelined(rank: int, world_size: int, seeds: list[int]) -> dict[int, dict[str, Any]]:
    from lightning_gpipe import GPipeStrategy

    torch.set_num_threads(1)
    runs = {}
    for seed in seeds:
        chosen = pipeline(seed, world_size)
        if chosen is not None:
            runs[seed] = _fit(seed, GPipeStrategy(**chosen), world_size) | {"pipeline": chosen}
    return runs
