"""Small LightningModules and data for the tests; none of them imports lightning_gpipe."""

from __future__ import annotations

import os
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from _engine_workers import Annealed, PythonLayerDrop, RunningCenter
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 6, 3


def dataset(samples: int = 40, seed: int = 1234) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (samples,), generator=generator)
    return TensorDataset(x, y)


def loader(batch_size: int = 8, shuffle: bool = True, samples: int = 40) -> DataLoader:
    return DataLoader(dataset(samples), batch_size=batch_size, shuffle=shuffle)


class StopGradient(nn.Module):
    """``x.detach()``: the layers before it get no gradient (``.grad`` stays ``None``), as in SimSiam's target."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


def mlp(
    dropout: float = 0.0,
    inplace: bool = False,
    stop_gradient: bool = False,
    host_random: bool = False,
    python_state: bool = False,
) -> nn.Sequential:
    """Seven layers of uneven sizes, so that parameter-count splits are uneven too.

    ``host_random``: the two ``Tanh`` are skipped at random, by draws from Python's ``random`` and from NumPy's global
    generator (:class:`_engine_workers.PythonLayerDrop`, which draws in evaluation too). ``python_state``: the ``ReLU``
    is followed by layers that keep state in plain attributes and change it in their forward
    (:class:`_engine_workers.Annealed`, :class:`_engine_workers.RunningCenter`).

    ``inplace``: eight layers instead, every even one an in-place ``LeakyReLU`` (not idempotent, so one
    applied twice shows), which :data:`INPLACE_BALANCE` puts first on every stage. ``stop_gradient``: a
    :class:`StopGradient` at index 2 (eight layers), which :data:`INPLACE_BALANCE` puts first on stage 1.
    """
    if inplace:
        sizes = [FEATURES, 16, 24, 12, 8]
        pairs = [(nn.LeakyReLU(0.1, inplace=True), nn.Linear(a, b)) for a, b in zip(sizes, sizes[1:])]
        return nn.Sequential(*(layer for pair in pairs for layer in pair))
    layers: list[nn.Module] = [
        nn.Linear(FEATURES, 16),
        nn.Tanh(),
        nn.Linear(16, 24),
        nn.ReLU(),
        nn.Linear(24, 12),
        nn.Tanh(),
        nn.Linear(12, 8),
    ]
    if host_random:
        layers[1], layers[5] = PythonLayerDrop(layers[1]), PythonLayerDrop(layers[5], numpy=True)
    if python_state:
        layers[3] = nn.Sequential(layers[3], Annealed(), RunningCenter(24))
    if dropout:
        layers.insert(2, nn.Dropout(dropout))
        layers.insert(6, nn.Dropout(dropout))
    if stop_gradient:
        layers.insert(2, StopGradient())
    return nn.Sequential(*layers)


#: Splits of ``mlp(inplace=True)`` that start every stage with an in-place layer, by the number of stages; of
#: ``mlp(stop_gradient=True)``, that start stage 1 with the stop-gradient.
INPLACE_BALANCE = {1: [8], 2: [2, 6], 3: [2, 2, 4], 4: [2, 2, 2, 2]}


class Net(L.LightningModule):
    """A backbone Sequential and a small head outside it; records what the tests compare."""

    #: read ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (a OneCycleLR's total), which sets the
    #: training data up then, before a resume reads its checkpoint
    estimate_steps = False

    def __init__(
        self,
        optimizer: str = "sgd",
        dropout: float = 0.0,
        head_dropout: float = 0.0,
        stem: bool = False,
        scheduler: bool = False,
        sync_dist: bool = False,
        inplace: bool = False,
        stop_gradient: bool = False,
        detach_output: bool = False,
        host_random: bool = False,
        python_state: bool = False,
    ):
        super().__init__()
        self.optimizer_name, self.scheduler, self.sync_dist = optimizer, scheduler, sync_dist
        self.detach_output = detach_output  # the head alone learns; the backbone's .grad stays None
        self.stem = nn.Linear(FEATURES, FEATURES) if stem else None
        self.backbone = mlp(dropout, inplace, stop_gradient, host_random, python_state)
        self.head = nn.Sequential(nn.Dropout(head_dropout), nn.Linear(8, CLASSES))
        self.losses: list[float] = []
        self.first_grads: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stem is not None:
            x = self.stem(x)
        features = self.backbone(x)
        return self.head(features.detach() if self.detach_output else features)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def on_before_optimizer_step(self, optimizer):
        if self.global_step == 0:
            self.first_grads = {n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None}

    def configure_optimizers(self):
        if self.estimate_steps:
            self.estimated_steps = self.trainer.estimated_stepping_batches
        optimizer = self._optimizer()
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        # what the optimizer holds on this rank (named_parameters() lists the whole model while it is built)
        self.optimized = [n for n, p in self.named_parameters() if id(p) in held]
        self.listed = [(n, p.numel()) for n, p in self.named_parameters()]  # what user code sees here
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.7)}

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        elif self.optimizer_name == "adamw":  # decays every parameter with a gradient, a zero one too (not None)
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        elif self.optimizer_name == "adamw-by-name":  # no decay on the first layer, chosen by name (a tie's first)
            first = [p for n, p in self.named_parameters() if n.startswith("backbone.0.")]
            rest = [p for n, p in self.named_parameters() if not n.startswith("backbone.0.")]
            groups = [{"params": first, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.1}]
            optimizer = torch.optim.AdamW(groups, lr=0.01)
        elif self.optimizer_name == "sgd-plain":  # keeps no state at all
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return optimizer


def trainer_kwargs(**overrides) -> dict:
    """Quiet, small runs: 5 steps, no logger, no checkpoints, no progress bar."""
    kwargs = dict(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def fit_record(model: Net, trainer: L.Trainer, data: DataLoader, val: Optional[DataLoader] = None) -> dict:
    """Fit, then return the losses, the first step's gradients and the final weights."""
    trainer.fit(model, data, val)
    return {
        "losses": list(model.losses),
        "grads": {k: v.cpu() for k, v in model.first_grads.items()},
        "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimized": list(model.optimized),
        "listed": list(model.listed),
        "kept": [m.kept() for m in model.modules() if hasattr(m, "kept")],  # the plain attributes layers keep
    }


def tied_mlp() -> nn.Sequential:
    """Seven layers whose last one shares its weight with the first and its bias with the third.

    The first and the last layer land on the first and the last stage, as an embedding and the output
    layer of a language model do; the ties are the same Parameter object, as ``last.weight = first.weight``.
    """
    layers = [
        nn.Linear(FEATURES, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, FEATURES),
        nn.Tanh(),
        nn.Linear(FEATURES, 8),
    ]
    layers[6].weight = layers[0].weight
    layers[6].bias = layers[2].bias
    return nn.Sequential(*layers)


#: The tied copies' local names (on the stage of layer 6) -> their one-device names.
TIED_ALIASES = {"backbone.6.weight": "backbone.0.weight", "backbone.6.bias": "backbone.2.bias"}


def is_tied(backbone: nn.Module) -> bool:
    """Whether the ties of :func:`tied_mlp` are the same Parameter objects."""
    return backbone[6].weight is backbone[0].weight and backbone[6].bias is backbone[2].bias


class TiedNet(Net):
    """:class:`Net` with the tied backbone.

    ``manual``: manual optimization with two backward passes per step (the halves of the batch) and
    norm clipping.
    """

    def __init__(
        self, optimizer: str = "sgd", manual: bool = False, same_layer_twice: bool = False, detach_output: bool = False
    ):
        super().__init__(optimizer=optimizer, detach_output=detach_output)
        if same_layer_twice:  # one Linear object at indices 1 and 3
            shared = nn.Linear(8, 8)
            self.backbone = nn.Sequential(nn.Linear(FEATURES, 8), shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(8, 8))
        else:
            self.backbone = tied_mlp()
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        optimizer = self.optimizers()
        x, y = batch
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):  # gradients accumulate over two backward passes
            loss = F.cross_entropy(self(xs), ys) * (len(xs) / len(x))
            self.manual_backward(loss)
            total += loss.item()
        self.losses.append(total)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()


class Writer(BasePredictionWriter):
    """Lightning's documented prediction writer: every rank saves what it predicted under its global rank."""

    def __init__(self, directory: str, interval: str) -> None:
        super().__init__(interval)
        self.directory = directory

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        torch.save(prediction, os.path.join(self.directory, f"batch_{batch_idx}_{trainer.global_rank}.pt"))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        saved = {"predictions": predictions, "indices": batch_indices}
        torch.save(saved, os.path.join(self.directory, f"predictions_{trainer.global_rank}.pt"))
