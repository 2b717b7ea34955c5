"""Ordinary Lightning and PyTorch features, each a small training run that `test_compatibility.py` runs twice.

Once pipelined (K=2, in two processes) and once on one device without this package; the test compares
what each scenario records. Every scenario builds its own module, data and Trainer settings, so that one
spawn of two processes can run them all (``import torch`` costs seconds per process).
"""

from __future__ import annotations

import copy
import csv
import glob
import os
import random
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ThroughputMonitor,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, TensorDataset, random_split

FEATURES, CLASSES, SAMPLES, BATCH = 6, 3, 32, 8

#: this process's rank in the run (0 on one device): a scenario may build what an unseeded process would
PROCESS_RANK = 0


def _data(samples: int = SAMPLES, tokens: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 20, (samples, 5), generator=g) if tokens else torch.randn(samples, FEATURES, generator=g)
    return TensorDataset(x, torch.randint(0, CLASSES, (samples,), generator=g))


def _loader(**kwargs: Any) -> DataLoader:
    return DataLoader(_data(**kwargs), batch_size=BATCH)


def _backbone() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, CLASSES))


class Base(L.LightningModule):
    """A backbone and nothing else; the scenarios change one thing each."""

    def __init__(self, backbone: Optional[nn.Sequential] = None) -> None:
        super().__init__()
        self.backbone = backbone if backbone is not None else _backbone()
        self.record: dict[str, Any] = {}

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.backbone(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@dataclass
class Scenario:
    module: L.LightningModule
    #: None: the module's own ``train_dataloader`` hook; a ``CombinedLoader`` for several sources
    train: Any = field(default_factory=_loader)
    val: Optional[DataLoader] = None
    trainer: dict[str, Any] = field(default_factory=dict)
    callbacks: list[Any] = field(default_factory=list)
    logger: bool = False
    #: run before ``fit`` with the Trainer, the module and the training data (a tuner)
    before_fit: Optional[Callable[[L.Trainer, L.LightningModule, DataLoader], None]] = None
    #: run after ``fit`` with the same arguments and the validation data (more calls on the same Trainer)
    after_fit: Optional[Callable[[L.Trainer, L.LightningModule, DataLoader, Optional[DataLoader]], None]] = None


# -- the scenarios --------------------------------------------------------------------------------------


def accumulate_grad_batches() -> Scenario:
    return Scenario(Base(), trainer={"accumulate_grad_batches": 2})


def clip_by_norm() -> Scenario:
    return Scenario(Base(), trainer={"gradient_clip_val": 0.05})


def clip_by_value() -> Scenario:
    return Scenario(Base(), trainer={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"})


class WithStepLR(Base):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def lr_scheduler() -> Scenario:
    return Scenario(WithStepLR())


class WithPlateau(Base):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=10.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


def reduce_lr_on_plateau() -> Scenario:
    return Scenario(WithPlateau(), val=_loader(samples=16), trainer={"max_epochs": 3})


class Manual(Base):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.loss(batch))
        optimizer.step()


def manual_optimization() -> Scenario:
    return Scenario(Manual())


class TwoOptimizers(Base):
    """Manual optimization with one optimizer for the first half of the backbone and one for the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(self.loss(batch))
        first.step()
        second.step()

    def configure_optimizers(self) -> Any:
        named = list(self.named_parameters())
        early = [p for n, p in named if n.split(".")[1] in ("0", "1", "2")]
        late = [p for n, p in named if n.split(".")[1] not in ("0", "1", "2")]
        # a param group may be empty on a stage that holds none of those layers
        return torch.optim.SGD([{"params": early}], lr=0.1), torch.optim.Adam([{"params": late}], lr=0.01)


def two_optimizers() -> Scenario:
    return Scenario(TwoOptimizers())


def early_stopping() -> Scenario:
    stop = EarlyStopping(monitor="train_loss_epoch", min_delta=1e3, patience=1, mode="min")
    return Scenario(Base(), trainer={"max_epochs": 6}, callbacks=[stop])


class Metrics(Base):
    """torchmetrics in training and validation: a mean (Accuracy), a sum and a concatenation, and all_gather."""

    def __init__(self) -> None:
        super().__init__()
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.seen = torchmetrics.SumMetric()
        self.targets = torchmetrics.CatMetric()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        self.seen.update(torch.tensor(float(len(y))))
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.record.setdefault("samples_seen", []).append(self.seen.compute().item())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.backbone(x)
        self.accuracy(logits, y)
        self.targets.update(y.float())
        self.log("val_acc", self.accuracy, on_epoch=True)
        self.log("val_loss_sync", F.cross_entropy(logits, y), sync_dist=True)
        gathered = self.all_gather(logits.sum())
        self.record.setdefault("all_gather_shapes", []).append(tuple(gathered.shape))

    def on_validation_epoch_end(self) -> None:
        self.record["val_targets"] = self.targets.compute().tolist()
        self.targets.reset()


class MetricsInACallback(L.Callback):
    """torchmetrics kept outside the module: one made with the callback, one in its ``setup``, one each epoch."""

    def __init__(self) -> None:
        self.seen = torchmetrics.SumMetric()
        self.after_fit = torchmetrics.SumMetric()  # computed by the script once `fit` returned
        self.confusion: Optional[torchmetrics.Metric] = None
        self.targets: Optional[torchmetrics.Metric] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.confusion = torchmetrics.ConfusionMatrix(task="multiclass", num_classes=CLASSES)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.targets = torchmetrics.CatMetric()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.confusion is not None and self.targets is not None
        x, y = batch
        self.seen.update(torch.tensor(float(len(y))))
        self.after_fit.update(torch.tensor(float(len(y))))
        self.targets.update(y.float())
        with torch.no_grad():
            self.confusion.update(pl_module.backbone(x).argmax(1), y)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        assert self.confusion is not None and self.targets is not None
        record = pl_module.record.setdefault("callback", [])
        record.append((self.seen.compute().item(), self.confusion.compute().tolist(), self.targets.compute().tolist()))


def _computed_after_fit(trainer: L.Trainer, module: Any, train: DataLoader, val: Optional[DataLoader]) -> None:
    callback = next(c for c in trainer.callbacks if isinstance(c, MetricsInACallback))  # type: ignore[attr-defined]
    module.record["after_fit"] = callback.after_fit.compute().item()


def metrics() -> Scenario:
    # the callback's metrics synced over every rank: each sample counted once per stage (64 for 32 at K=2)
    callbacks = [MetricsInACallback()]
    return Scenario(Metrics(), val=_loader(samples=16), callbacks=callbacks, after_fit=_computed_after_fit)


class Contrastive(Base):
    """A contrastive loss over the features of every data-parallel rank, gathered with their gradients (SimCLR's,
    CLIP's): each sample's view against the other view of every sample of the global batch."""

    def loss(self, batch: Any) -> Tensor:
        x, _ = batch
        anchors = F.normalize(self.backbone(x), dim=1)
        gathered = self.all_gather(F.normalize(self.backbone(x + 0.1), dim=1), sync_grads=True)
        if gathered.dim() == 2:  # one device: the tensor itself, not stacked
            gathered = gathered.unsqueeze(0)
        rank = self.trainer.strategy.distributed_sampler_kwargs["rank"] if len(gathered) > 1 else 0
        return F.cross_entropy(anchors @ gathered.flatten(0, 1).T / 0.1, torch.arange(len(x)) + rank * len(x))


def contrastive_all_gather() -> Scenario:
    # with replicas, `all_gather(sync_grads=True)` failed in its backward: torch's differentiable gather scatters from
    # group ranks taken as global ones on gloo ("Global rank 1 is not part of group")
    return Scenario(Contrastive())


def loggers_and_lr_monitor() -> Scenario:
    return Scenario(
        WithStepLR(),
        callbacks=[LearningRateMonitor(logging_interval="step")],
        logger=True,
        trainer={"log_every_n_steps": 1},
    )


class WithFlops(Base):
    """Declares its flops per batch, as ``ThroughputMonitor`` reads them (a made-up, fixed count)."""

    flops_per_batch = 1000.0


def throughput_monitor() -> Scenario:
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: len(batch[0]), window_size=2)
    return Scenario(WithFlops(), callbacks=[monitor], logger=True, trainer={"log_every_n_steps": 1})


def compiled_layers() -> Scenario:
    backbone = _backbone()
    for layer in backbone:
        layer.compile(backend="eager")  # compiled layers run inside the stages as they are
    return Scenario(Base(backbone))


def scripted_layers() -> Scenario:
    """Layers compiled by ``torch.jit.script`` first and last (a stage each): every rank puts the other stage's
    scripted layer back at the end of ``fit``, which ``to_empty`` refused ("not supported on ScriptModules")."""
    backbone = _backbone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated, and still used
        backbone[0] = torch.jit.script(backbone[0])
        backbone[4] = torch.jit.script(nn.Sequential(backbone[4]))
    return Scenario(Base(backbone))


class OwnNoise(nn.Module):
    """Multiplicative noise in training, drawn from a ``torch.Generator`` of the layer's own (seeded once)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(123)

    def forward(self, x: Tensor) -> Tensor:
        return x * (1 + 0.5 * torch.rand(x.shape, generator=self.generator)) if self.training else x


def layer_with_its_own_generator() -> Scenario:
    """The recompute, the balance profile and the per-sample check each drew from the layer's generator again:
    the recompute's noise was not the forward's (4.5e-3 off one device after 4 steps with `checkpoint="always"`), and
    the profile moved the stream before the first step (5.4e-3)."""
    backbone = _backbone()
    backbone.insert(2, OwnNoise())
    return Scenario(Base(backbone))


class Language(Base):
    """Tokens in, an Embedding first: the first stage takes integer input, which has no gradient."""

    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(nn.Embedding(20, 4), nn.Flatten(), nn.Linear(20, 12), nn.Tanh(), nn.Linear(12, CLASSES))
        )


def embedding_first() -> Scenario:
    return Scenario(Language(), train=_loader(tokens=True))


def sparse_embedding_first() -> Scenario:
    """``nn.Embedding(sparse=True)``: sparse gradients, accumulated over 2 batches and clipped by norm. The default
    balance profiles it (by time), whose byte count took the sparse gradient's storage and failed."""
    module = Language()
    module.backbone[0] = nn.Embedding(20, 4, sparse=True)
    settings = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    return Scenario(module, train=_loader(tokens=True), trainer=settings)


class Twice(Base):
    """Two backbone calls in one step (a siamese loss); the drain runs once per call."""

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.backbone(x), y) + 0.5 * self.backbone(x.flip(0)).square().mean()


def backbone_called_twice() -> Scenario:
    return Scenario(Twice())


class _ToSpectrum(nn.Module):
    """A linear layer, then the spectrum of its output: complex activations leave this layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 16)

    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.rfft(self.linear(x).tanh(), dim=-1)


class _SpectralMix(nn.Module):
    """A complex weight per frequency, as in a Fourier neural operator's layer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(9, dtype=torch.complex64) * 0.3)

    def forward(self, z: Tensor) -> Tensor:
        return z + z * self.weight


class _FromSpectrum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, CLASSES)

    def forward(self, z: Tensor) -> Tensor:
        return self.linear(torch.fft.irfft(z, n=16, dim=-1))


def complex_activations() -> Scenario:
    # every boundary of this backbone carries a complex tensor; clipped by norm (a complex weight's |g| counts)
    backbone = nn.Sequential(_ToSpectrum(), _SpectralMix(), _SpectralMix(), _SpectralMix(), _FromSpectrum())
    return Scenario(Base(backbone), trainer={"gradient_clip_val": 0.5})


class Split(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.tanh()


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return self.linear(pair[0]) * pair[1]


def tuples_across_stages() -> Scenario:
    backbone = nn.Sequential(nn.Linear(FEATURES, FEATURES), Split(), Join(), nn.Linear(FEATURES, CLASSES))
    return Scenario(Base(backbone))  # split [2, 2]: the pair crosses the boundary


class _ToDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: Tensor) -> dict[str, Any]:
        return {"x": self.linear(x), "mask": None, "scale": 0.5}


class _DictTanh(nn.Module):
    def forward(self, d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "x": torch.tanh(d["x"]) * d["scale"]}


class _BatchFirstLSTM(nn.Module):
    """An LSTM over the features as 3 steps of 2, returning ``(output, (h, c))`` with ``h`` and ``c`` batch first."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(2, 4, batch_first=True)

    def forward(self, d: dict[str, Any]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        out, (h, c) = self.lstm(d["x"].view(-1, FEATURES // 2, 2))
        return out, (h.transpose(0, 1), c.transpose(0, 1))


class _LastState(nn.Module):
    def forward(self, pair: tuple[Tensor, tuple[Tensor, Tensor]]) -> Tensor:
        out, (h, c) = pair
        return (out + h + c).flatten(1)


def structures_across_stages() -> Scenario:
    # a dict with a None and a float beside the tensor, then an LSTM wrapper's nested (output, (h, c)): the split
    # by time cuts at one of them
    layers = [_ToDict(), _DictTanh(), _BatchFirstLSTM(), _LastState(), nn.Linear(4 * FEATURES // 2, CLASSES)]
    return Scenario(Base(nn.Sequential(*layers)))


@dataclass
class Images:
    """A batch as a dataclass, with a string per sample beside the tensors (Lightning moves the tensors)."""

    x: Tensor
    y: Tensor
    names: list[str]


def _images(samples: list[tuple[Tensor, Tensor]]) -> Images:
    xs, ys = zip(*samples)
    return Images(torch.stack(xs), torch.stack(ys), [f"sample {int(y)}" for y in ys])


@dataclass(frozen=True)
class Hidden:
    """A layer's output as a frozen dataclass, with a field ``__init__`` does not take."""

    h: Tensor
    gate: Tensor
    kind: str = field(default="hidden", init=False)


class _FromImages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, batch: Images) -> Hidden:
        h = self.linear(batch.x)
        return Hidden(h, torch.sigmoid(h))


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, hidden: Hidden) -> Hidden:
        return Hidden(torch.tanh(self.linear(hidden.h)) * hidden.gate, hidden.gate)


class _Ungate(nn.Module):
    def forward(self, hidden: Hidden) -> Tensor:
        return hidden.h + hidden.gate


class WholeBatchIn(Base):
    """The backbone takes the loader's batch itself, a dataclass."""

    def loss(self, batch: Images) -> Tensor:
        return F.cross_entropy(self.backbone(batch), batch.y)


def dataclass_batches() -> Scenario:
    # the batch is a dataclass the backbone takes whole (cut field by field, its strings kept), and dataclasses
    # cross the stage boundaries (the split by time cuts between the layers that pass them)
    layers = [_FromImages(), _Gated(), _Gated(), _Ungate(), nn.Linear(FEATURES, CLASSES)]
    train = DataLoader(_data(), batch_size=BATCH, collate_fn=_images)
    return Scenario(WholeBatchIn(nn.Sequential(*layers)), train=train)


class TunedRate(Base):
    """A learning rate that Lightning's learning rate finder sets (``lr``, read in ``configure_optimizers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 0.01

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _find_rate(trainer: L.Trainer, module: L.LightningModule, train: DataLoader) -> None:
    from lightning.pytorch.tuner import Tuner

    found = Tuner(trainer).lr_find(module, train_dataloaders=train, num_training=30, early_stop_threshold=None)
    module.record["lr_find"] = {"suggestion": found.suggestion(), "losses": found.results["loss"], "lr": module.lr}


def lr_finder() -> Scenario:
    return Scenario(TunedRate(), train=_loader(samples=160), before_fit=_find_rate)  # room for 30 steps in 2 epochs


class Unseeded(Base):
    """Weights drawn from each process's own stream, as a script that the launcher runs once per process and that
    builds its model before seeding: DDP trains rank 0's (its constructor broadcasts them), and so must a pipeline.
    One device draws rank 0's."""

    def __init__(self) -> None:
        torch.manual_seed(100 + PROCESS_RANK)
        super().__init__()
        self.head = nn.Linear(CLASSES, CLASSES)  # outside the backbone: replicated on every stage

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)


def unseeded_initial_weights() -> Scenario:
    return Scenario(Unseeded())


class RandomSplit(L.LightningDataModule):
    """An unseeded ``random_split`` in ``setup`` (a common DataModule) and a shuffled training loader."""

    def setup(self, stage: str) -> None:
        self.train, self.val = random_split(_data(40), [32, 8])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=BATCH, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=BATCH)


def unseeded_data_split() -> Scenario:
    """A script that never seeds: each process's generators stand elsewhere when Lightning's setup hooks draw.
    One device is rank 0's process (the DataModule goes where ``fit`` takes its loader)."""
    module = Base()
    torch.manual_seed(200 + PROCESS_RANK)
    random.seed(200 + PROCESS_RANK)
    np.random.seed(200 + PROCESS_RANK)
    return Scenario(module, train=RandomSplit())  # type: ignore[arg-type]


def double_precision() -> Scenario:
    return Scenario(Base(), trainer={"precision": "64-true"})


def bf16_true() -> Scenario:
    return Scenario(Base(), trainer={"precision": "bf16-true"})


def half_true() -> Scenario:
    return Scenario(Base(), trainer={"precision": "16-true"})


def loop_limits() -> Scenario:
    """Lightning's loop settings: fewer batches, validation every other epoch, sanity batches before fit."""
    settings = {"max_epochs": 3, "limit_train_batches": 3, "limit_val_batches": 1, "check_val_every_n_epoch": 2}
    return Scenario(Base(), val=_loader(samples=16), trainer={**settings, "num_sanity_val_steps": 1})


def overfit_batches() -> Scenario:
    return Scenario(Base(), val=_loader(samples=16), trainer={"overfit_batches": 2})


def fast_dev_run() -> Scenario:
    # with a logger, which fast_dev_run swaps for its DummyLogger: that one was taken for a graph-tracing logger
    return Scenario(Base(), val=_loader(samples=16), trainer={"fast_dev_run": 2}, logger=True)


def accumulation_scheduler() -> Scenario:
    return Scenario(Base(), callbacks=[GradientAccumulationScheduler(scheduling={0: 1, 1: 3})])


def detect_anomaly() -> Scenario:
    return Scenario(Base(), trainer={"detect_anomaly": True})


class BuiltInConfigureModel(Base):
    """The backbone made in Lightning's ``configure_model`` hook, which runs before the strategy's setup."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.backbone is None:
            self.backbone = _backbone()


def backbone_in_configure_model() -> Scenario:
    return Scenario(BuiltInConfigureModel())


class Toggled(TwoOptimizers):
    """The same two optimizers stepped in turn, each with ``toggle_optimizer`` (a GAN's loop): the other's layers
    frozen meanwhile."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for optimizer in self.optimizers():
            self.toggle_optimizer(optimizer)
            optimizer.zero_grad()
            self.manual_backward(self.loss(batch))
            optimizer.step()
            self.untoggle_optimizer(optimizer)


def toggled_optimizers() -> Scenario:
    return Scenario(Toggled())


class OwnClipping(Base):
    """``configure_gradient_clipping`` overridden: clips by norm through ``self.clip_gradients`` from epoch 1 on."""

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if self.current_epoch >= 1:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def clipping_hook() -> Scenario:
    return Scenario(OwnClipping())


class Collection(Base):
    """A torchmetrics ``MetricCollection`` logged with ``self.log_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.scores = torchmetrics.MetricCollection(
            {
                "acc": torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES),
                "f1": torchmetrics.F1Score(task="multiclass", num_classes=CLASSES, average="macro"),
            },
            prefix="val_",
        )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.scores.update(self.backbone(x), y)
        self.log_dict(self.scores, on_epoch=True)


def metric_collection() -> Scenario:
    return Scenario(Collection(), val=_loader(samples=16))


class DrawOnRankZero(L.Callback):
    """Picks samples to show on rank zero only (a common logging callback): draws from torch, Python and NumPy."""

    @rank_zero_only
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        random.random()

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        torch.randint(0, SAMPLES, (4,))
        np.random.rand()


class RandomOutsideBackbone(Base):
    """Dropout before the backbone and in a head, both drawn from the global generators."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Dropout(0.2)
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(CLASSES, CLASSES))

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        noise = 1.0 + 0.1 * torch.randn(()).item() + 0.1 * random.random()  # augmentation in the step
        return F.cross_entropy(self.head(self.backbone(self.stem(x) * noise)), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.is_global_zero:  # the module's own hook, after every callback's
            torch.rand(3)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.is_global_zero:
            torch.rand(3)


class Augmented(TensorDataset):
    """Noise drawn from torch's global generator in ``__getitem__``, in the main process (a random transform)."""

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        x, y = super().__getitem__(index)
        return x + 0.1 * torch.randn(x.shape), y


class AugmentedInWorkers(TensorDataset):
    """A random transform that draws from torch, Python and NumPy in DataLoader workers (flips, noise, scales)."""

    def __getitem__(self, index: int) -> tuple[Tensor, ...]:
        x, y = super().__getitem__(index)
        x = x.flip(0) if random.random() < 0.5 else x
        return x * float(np.random.uniform(0.8, 1.2)) + 0.1 * torch.randn(x.shape), y


def workers_seeded_by_lightning() -> Scenario:
    """``seed_everything(0, workers=True)`` (what LightningCLI calls) with augmentation in 2 persistent workers,
    shuffled.

    The loader's own generator draws the workers' base seed, as on one device; without it the base seed
    comes from the global generator, which Lightning's DDP leaves elsewhere than one device does.
    """
    L.seed_everything(0, workers=True, verbose=False)  # run()'s own call, plus Lightning's worker seeding
    data = AugmentedInWorkers(*_data().tensors)
    generator = torch.Generator().manual_seed(5)
    workers = dict(num_workers=2, persistent_workers=True, generator=generator)
    train = DataLoader(data, batch_size=BATCH, shuffle=True, **workers)
    return Scenario(Base(), train=train)


def rank_zero_random_draws() -> Scenario:
    data = _data()
    train = DataLoader(Augmented(*data.tensors), batch_size=BATCH)
    return Scenario(
        RandomOutsideBackbone(),
        train=train,
        val=_loader(samples=16),
        callbacks=[DrawOnRankZero()],
        trainer={"max_epochs": 3},
    )


class ShrinkHeadOnRankZero(L.Callback):
    """Rescales the head's weights on rank zero only after each batch: a hand-made decay a user wrote as a
    callback and decorated like their logging callbacks."""

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            pl_module.head.weight.mul_(0.9)


class OuterLayers(Base):
    """A stem with a BatchNorm and a head outside the backbone: every stage holds a copy of both."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.BatchNorm1d(FEATURES)
        self.head = nn.Linear(CLASSES, CLASSES)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(self.stem(x))), y)

    def on_train_epoch_end(self) -> None:
        if self.trainer.is_global_zero:  # the module's own hook: a stem statistic reset on rank 0 only
            self.stem.running_var.fill_(1.0)
            self.head.bias.data.add_(0.1)


def rank_zero_weight_changes() -> Scenario:
    return Scenario(OuterLayers(), val=_loader(samples=16), callbacks=[ShrinkHeadOnRankZero()])


class Evaluated(Base):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.backbone(batch[0])


def _validate_test_predict_and_fit_on(
    trainer: L.Trainer, module: L.LightningModule, train: DataLoader, val: Optional[DataLoader]
) -> None:
    """What a script does with a Trainer after ``fit``: evaluate, predict, then train one epoch more."""
    module.record["validate"] = trainer.validate(module, val, verbose=False)
    module.record["test"] = trainer.test(module, val, verbose=False)
    module.record["predict"] = [p.detach().clone() for p in trainer.predict(module, val) or []]
    trainer.fit_loop.max_epochs = trainer.current_epoch + 1
    trainer.fit(module, train, val)


def same_trainer_after_fit() -> Scenario:
    return Scenario(Evaluated(), val=_loader(samples=16), after_fit=_validate_test_predict_and_fit_on)


def _evaluate_the_best(
    trainer: L.Trainer, module: L.LightningModule, train: DataLoader, val: Optional[DataLoader]
) -> None:
    """``test``, ``validate`` and ``predict`` with ``ckpt_path="best"``: the monitored checkpoint's weights."""
    module.record["best"] = os.path.basename(trainer.checkpoint_callback.best_model_path)  # type: ignore[union-attr]
    module.record["test"] = trainer.test(module, val, ckpt_path="best", verbose=False)
    module.record["validate"] = trainer.validate(module, val, ckpt_path="best", verbose=False)
    module.record["predict"] = [p.detach().clone() for p in trainer.predict(module, val, ckpt_path="best") or []]


def best_checkpoint() -> Scenario:
    """``ModelCheckpoint`` keeps the epoch of the lowest validation loss; evaluated from its file. The labels are
    random, so the validation loss rises once the model overfits: the best is an early epoch, not the weights
    ``fit`` ends with, and evaluating "best" must load the file (the test checks that it is not the last)."""
    keep = ModelCheckpoint(monitor="val_loss", save_top_k=1, mode="min")
    return Scenario(
        Evaluated(),
        val=_loader(samples=16),
        callbacks=[keep],
        trainer={"enable_checkpointing": True, "max_epochs": 4},
        after_fit=_evaluate_the_best,
    )


class AveragedInInit(Base):
    """An EMA of the backbone with torch's ``AveragedModel``, made in ``__init__`` and updated after every batch (the
    pattern of torch's docs). Its layers have equal shapes, so a copy paired with the wrong layers would not fail."""

    def __init__(self) -> None:
        layers = [layer for _ in range(3) for layer in (nn.Linear(FEATURES, FEATURES), nn.Tanh())]
        super().__init__(nn.Sequential(*layers, nn.Linear(FEATURES, CLASSES)))
        self.ema = AveragedModel(self.backbone, multi_avg_fn=get_ema_multi_avg_fn(0.8))

    def on_train_batch_end(self, *args: Any) -> None:
        self.ema.update_parameters(self.backbone)


def averaged_model_in_init() -> Scenario:
    return Scenario(AveragedInInit(), val=_loader(samples=16))


class FrozenTeacher(Base):
    """Self-distillation: a frozen copy of the backbone, made in ``__init__``, whose outputs the loss follows. The
    copy is a layer outside the backbone that every stage runs whole; the strategy refuses only one that the stages
    update apart."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = copy.deepcopy(self.backbone).requires_grad_(False)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        out = self.backbone(x)
        return F.cross_entropy(out, y) + F.mse_loss(out, self.teacher(x))


def frozen_teacher() -> Scenario:
    return Scenario(FrozenTeacher())


class HookedBackbone(Base):
    """Hooks on the backbone Sequential itself (feature capture, activation statistics): a forward pre-hook that
    scales its input, a forward hook and a full backward hook that keep the norms of its output and its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Tensor] = {}
        self.backbone.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
        self.backbone.register_forward_hook(self._output)
        self.backbone.register_full_backward_hook(self._gradient)

    def _output(self, module: nn.Module, args: Any, output: Tensor) -> None:
        self.seen["output"] = output.detach().norm()

    def _gradient(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        self.seen["gradient"] = grad_output[0].detach().norm()

    def on_train_batch_end(self, *args: Any) -> None:
        self.log_dict({"hooked_output": self.seen.pop("output"), "hooked_gradient": self.seen.pop("gradient")})


def backbone_hooks() -> Scenario:
    return Scenario(HookedBackbone())


def weight_norm_layers() -> Scenario:
    """Weight normalization inside the backbone, both of torch's: the old one, a forward pre-hook on the layer that
    recomputes its weight, and the parametrization. Each runs on its layer's stage, per micro-batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated, and still used
        old = torch.nn.utils.weight_norm(nn.Linear(FEATURES, 12))
    new = torch.nn.utils.parametrizations.weight_norm(nn.Linear(12, 12))
    return Scenario(Base(nn.Sequential(old, nn.Tanh(), new, nn.Tanh(), nn.Linear(12, CLASSES))))


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    f.__name__: f
    for f in (
        accumulate_grad_batches,
        contrastive_all_gather,
        clip_by_norm,
        clip_by_value,
        lr_scheduler,
        reduce_lr_on_plateau,
        manual_optimization,
        two_optimizers,
        early_stopping,
        metrics,
        loggers_and_lr_monitor,
        compiled_layers,
        scripted_layers,
        layer_with_its_own_generator,
        embedding_first,
        sparse_embedding_first,
        backbone_called_twice,
        tuples_across_stages,
        structures_across_stages,
        complex_activations,
        dataclass_batches,
        lr_finder,
        throughput_monitor,
        same_trainer_after_fit,
        unseeded_initial_weights,
        unseeded_data_split,
        loop_limits,
        overfit_batches,
        fast_dev_run,
        accumulation_scheduler,
        detect_anomaly,
        backbone_in_configure_model,
        toggled_optimizers,
        clipping_hook,
        metric_collection,
        rank_zero_random_draws,
        workers_seeded_by_lightning,
        rank_zero_weight_changes,
        best_checkpoint,
        double_precision,
        bf16_true,
        half_true,
        averaged_model_in_init,
        frozen_teacher,
        backbone_hooks,
        weight_norm_layers,
    )
}


# scenarios of data loading, loop settings and the Trainer's utilities, in a file of their own (it imports the
# harness above, so it is imported once the harness exists)
from _compat_loop import SCENARIOS as _LOOP  # noqa: E402

SCENARIOS.update(_LOOP)


# -- running them ---------------------------------------------------------------------------------------


def _logged(directory: str) -> list[dict[str, str]]:
    files = glob.glob(os.path.join(directory, "**", "metrics.csv"), recursive=True)
    if not files:
        return []
    with open(files[0]) as f:
        return [{k: v for k, v in row.items() if v} for row in csv.DictReader(f)]


def run(name: str, strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """One scenario's training; what it learnt and recorded (the whole model is back in the module after fit)."""
    L.seed_everything(0, verbose=False)
    scenario = SCENARIOS[name]()
    with tempfile.TemporaryDirectory() as logs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = {"max_epochs": 2, "num_sanity_val_steps": 0, "enable_checkpointing": False, **scenario.trainer}
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=strategy,
            default_root_dir=logs,
            logger=CSVLogger(logs, name="run") if scenario.logger else False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=scenario.callbacks,
            **settings,
        )
        if scenario.before_fit is not None:
            scenario.before_fit(trainer, scenario.module, scenario.train)
        trainer.fit(scenario.module, scenario.train, scenario.val)
        if scenario.after_fit is not None:
            scenario.after_fit(trainer, scenario.module, scenario.train, scenario.val)
        logged = _logged(logs) if scenario.logger and trainer.is_global_zero else None
    return {
        "weights": {k: v.detach().clone() for k, v in scenario.module.state_dict().items()},
        "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
        "steps": trainer.global_step,
        "epochs": trainer.current_epoch,
        "record": scenario.module.record,
        "logged": logged,
        "warnings": [str(w.message) for w in caught],
    }


def one_device(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return {name: run(name) for name in names}


def pipelined(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    from lightning_gpipe import GPipeStrategy

    global PROCESS_RANK
    PROCESS_RANK = rank
    torch.set_num_threads(1)
    return {name: run(name, GPipeStrategy(chunks=2), world_size) for name in names}


def ddp(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return {name: run(name, "ddp", world_size) for name in names}


def pipelined_replicas(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Two data-parallel replicas of a two-stage pipeline (``world_size`` 4)."""
    from lightning_gpipe import GPipeStrategy

    torch.set_num_threads(1)
    return {name: run(name, GPipeStrategy(chunks=2, pipe_size=2), world_size) for name in names}
