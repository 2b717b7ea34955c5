"""More scenarios for `test_compatibility.py`: data loading, loop settings and the Trainer's utilities.

Each is what a user writes on one device and keeps under ``strategy="gpipe"``: loaders that the Trainer
rebuilds, combines or does not own, batch hooks that draw random numbers, profilers, device statistics,
loop limits counted in steps, frozen layers, a step that skips the backbone. The harness (``Scenario``,
``run``) is in ``_compat.py``, which registers these under their function names.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Iterator

import lightning as L
import torch
import torch.nn.functional as F
from _compat import BATCH, CLASSES, FEATURES, Base, Manual, Scenario, _backbone, _data, _loader
from lightning.pytorch.callbacks import DeviceStatsMonitor, EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset


def _shuffled() -> DataLoader:
    return DataLoader(_data(), batch_size=BATCH, shuffle=True)


def device_stats() -> Scenario:
    """Lightning's ``DeviceStatsMonitor``: each rank reads its own device, rank 0 logs (the CPU's, here)."""
    return Scenario(Base(), callbacks=[DeviceStatsMonitor()], logger=True, trainer={"log_every_n_steps": 1})


def simple_profiler() -> Scenario:
    return Scenario(Base(), trainer={"profiler": "simple"})


def advanced_profiler() -> Scenario:
    return Scenario(Base(), trainer={"profiler": "advanced"})


class Reloaded(Base):
    """A shuffled training loader built by the module's hook, which the Trainer calls again every epoch. The hook
    counts its calls and joins a collective: it takes rank 0's shuffling seed (a broadcast, a no-op on one device).
    """

    def train_dataloader(self) -> DataLoader:
        self.record["loaders_built"] = self.record.get("loaders_built", 0) + 1
        seed = self.trainer.strategy.broadcast(int(torch.randint(0, 2**31, ()).item()))
        return DataLoader(_data(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed))


def reloaded_every_epoch() -> Scenario:
    return Scenario(Reloaded(), train=None, trainer={"reload_dataloaders_every_n_epochs": 1, "max_epochs": 3})


class LevelSetAtFitStart(Base):
    """A training loader whose data depend on state set in ``on_fit_start`` (a curriculum's level), drawn at random
    in the hook from the global generator (which the harness seeds)."""

    level = 0

    def on_fit_start(self) -> None:
        self.level = 1

    def train_dataloader(self) -> DataLoader:
        self.record.setdefault("levels", []).append(self.level)
        x = torch.randn(len(_data()), FEATURES) * (1 + self.level)
        return DataLoader(torch.utils.data.TensorDataset(x, _data().tensors[1]), batch_size=BATCH, shuffle=True)


def loader_state_set_in_on_fit_start() -> Scenario:
    return Scenario(LevelSetAtFitStart(), train=None)


class TwoSources(Base):
    """Two training loaders at once (``CombinedLoader``): one batch of each per step, one of them shuffled."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch["plain"]) + self.loss(batch["shuffled"])
        self.log("train_loss", loss)
        return loss


def combined_loader() -> Scenario:
    both = CombinedLoader({"plain": _loader(), "shuffled": _shuffled()}, mode="max_size_cycle")
    return Scenario(TwoSources(), train=both)


class TwoValidationSets(Base):
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", self.loss(batch))


def two_validation_loaders() -> Scenario:
    """Logged per loader, as ``val_loss/dataloader_idx_0`` and ``_1``."""
    return Scenario(TwoValidationSets(), val=[_loader(samples=16), _loader(samples=8)])


class BatchHooks(Base):
    """Noise drawn in ``on_before_batch_transfer`` and a rescale in ``on_after_batch_transfer``."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x + 0.1 * torch.randn_like(x), y

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return 2 * x, y


def batch_transfer_hooks() -> Scenario:
    return Scenario(BatchHooks())


def deterministic_algorithms() -> Scenario:
    return Scenario(Base(), trainer={"deterministic": True})


def without_inference_mode() -> Scenario:
    return Scenario(Base(), val=_loader(samples=16), trainer={"inference_mode": False})


def own_sampler() -> Scenario:
    """``use_distributed_sampler=False``: the loader keeps its own shuffling sampler."""
    return Scenario(Base(), train=_shuffled(), trainer={"use_distributed_sampler": False})


class LoggedOnRankZero(Base):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, rank_zero_only=True)
        return loss


def log_rank_zero_only() -> Scenario:
    return Scenario(LoggedOnRankZero())


def min_epochs() -> Scenario:
    """``EarlyStopping`` that would stop after the first epoch, held back by ``min_epochs=3``."""
    stop = EarlyStopping("val_loss", patience=0, min_delta=10.0)
    return Scenario(Base(), val=_loader(samples=16), callbacks=[stop], trainer={"min_epochs": 3, "max_epochs": 5})


def barebones() -> Scenario:
    return Scenario(Base(), trainer={"barebones": True})


class OneCycle(Base):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def one_cycle_schedule() -> Scenario:
    return Scenario(OneCycle())


class Stream(IterableDataset):
    """Whole batches from an iterable dataset (no sampler for the Trainer to replace)."""

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        x, y = _data().tensors
        for start in range(0, len(x), BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]


def iterable_dataset() -> Scenario:
    return Scenario(Base(), train=DataLoader(Stream(), batch_size=None))


class DensifiedInStep(Base):
    """Batches that hold a sparse tensor (a bag of words, collated sparse), made dense in ``training_step``."""

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.backbone(x.to_dense()), y)


def _sparse_rows(rows: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.stack([x for x, _ in rows]).to_sparse(), torch.stack([y for _, y in rows])


def sparse_batches() -> Scenario:
    """The stages' batch check read every tensor's bits, which a sparse tensor has not: it failed with "reshape is
    not implemented for sparse tensors" before the backbone ran."""
    x, y = _data().tensors
    rows = list(zip(x.relu(), y))  # about half the features zero
    return Scenario(DensifiedInStep(), train=DataLoader(rows, batch_size=BATCH, collate_fn=_sparse_rows))


class SometimesWithoutBackbone(Base):
    """Every second step trains a bias alone, without calling the backbone: no stage has a pass to run."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(CLASSES))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if batch_idx % 2:
            return F.cross_entropy(self.bias.expand(len(y), -1), y)
        return F.cross_entropy(self.backbone(x) + self.bias, y)


def step_without_backbone() -> Scenario:
    return Scenario(SometimesWithoutBackbone())


class TargetWithoutGrad(Base):
    """A target from the backbone under ``torch.no_grad()``, then the backbone with gradients (consistency losses)."""

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        with torch.no_grad():
            target = self.backbone(x + 1)
        out = self.backbone(x)
        return F.cross_entropy(out, y) + F.mse_loss(out, target)


def backbone_under_no_grad() -> Scenario:
    return Scenario(TargetWithoutGrad())


class SaliencyFromItsOwnCall(Base):
    """An input gradient (a saliency map, logged) from a backbone call of its own, then the loss from another call.
    Its drain must fill no parameter's ``.grad``: with gradient accumulation no ``zero_grad`` comes between it and
    the next batch's backward."""

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        probe = x.clone().requires_grad_(True)
        (saliency,) = torch.autograd.grad(self.backbone(probe).sum(), probe)
        self.log("saliency", saliency.abs().mean())
        return F.cross_entropy(self.backbone(x), y)


def saliency_from_its_own_call() -> Scenario:
    return Scenario(SaliencyFromItsOwnCall(), trainer={"accumulate_grad_batches": 2})


class ManualSaliency(Manual, SaliencyFromItsOwnCall):
    """The same, under manual optimization: ``zero_grad``, the saliency map, ``manual_backward``, ``step``."""


def saliency_in_manual_optimization() -> Scenario:
    return Scenario(ManualSaliency())


class BackwardOfSome(Base):
    """``manual_backward(loss, inputs=...)`` with a stem before the backbone and a head after it: the stem's
    parameters (the backward runs through the pipeline, for its input gradient only) or the head's (it does not)."""

    def __init__(self, inputs: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.stem = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(CLASSES, CLASSES)
        self.inputs = inputs

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(self.stem(x))), y)
        self.manual_backward(loss, inputs=list(getattr(self, self.inputs).parameters()))
        optimizer.step()


def backward_inputs_stem() -> Scenario:
    return Scenario(BackwardOfSome("stem"))


def backward_inputs_head() -> Scenario:
    return Scenario(BackwardOfSome("head"))


class FrozenBackbone(Base):
    """A frozen backbone (a feature extractor) and a trained head: no gradient reaches any stage."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(CLASSES, CLASSES)

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)


def frozen_backbone() -> Scenario:
    return Scenario(FrozenBackbone())


class FrozenLastLayer(Base):
    def __init__(self) -> None:
        super().__init__()
        self.backbone[-1].requires_grad_(False)


def frozen_last_layer() -> Scenario:
    return Scenario(FrozenLastLayer())


def validation_every_two_steps() -> Scenario:
    return Scenario(Base(), val=_loader(samples=16), trainer={"val_check_interval": 2})


class Autocast(Base):
    """``torch.autocast`` around the backbone in the user's step, instead of the Trainer's precision setting."""

    def loss(self, batch: Any) -> Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.backbone(x)
        return F.cross_entropy(out.float(), y)


def autocast_in_step() -> Scenario:
    return Scenario(Autocast())


class LoadedOnFitStart(Base):
    """Loads fixed backbone weights in ``on_fit_start``, after the split: each stage takes its own layers' entries."""

    def on_fit_start(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.backbone.load_state_dict(
            {k: torch.randn(v.shape, generator=g) for k, v in _backbone().state_dict().items()}
        )


def weights_loaded_in_on_fit_start() -> Scenario:
    return Scenario(LoadedOnFitStart())


def _build_under_init_module(trainer: Any, module: Any, train: Any) -> None:
    with trainer.init_module():  # Lightning's context for building a model where the strategy wants it
        module.backbone = _backbone()


def built_under_init_module() -> Scenario:
    return Scenario(Base(), before_fit=_build_under_init_module)


def module_in_two_places() -> Scenario:
    # one Linear object at layers 2 and 4 (a weight-shared block applied twice): the default split by time keeps
    # layers 2-4 on one stage; it put them on two before, and setup failed
    shared = nn.Linear(12, 12)
    layers = [nn.Linear(FEATURES, 12), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(12, CLASSES)]
    return Scenario(Base(nn.Sequential(*layers)))


class _Sequence(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], 3, FEATURES // 3)


class _LastStep(nn.Module):
    def forward(self, pair: Any) -> Tensor:
        out, (h, _) = pair
        return (out + h[-1].unsqueeze(1)).flatten(1)


def lstm_in_backbone() -> Scenario:
    # an nn.LSTM returns (output, (h, c)), which cannot cross to another stage: the default split by time keeps the
    # layer after it on its stage; profiling failed on the nested output before, and setup with it
    lstm = nn.LSTM(FEATURES // 3, 8, batch_first=True)
    return Scenario(Base(nn.Sequential(_Sequence(), lstm, _LastStep(), nn.Tanh(), nn.Linear(24, CLASSES))))


def lstm_single_samples() -> Scenario:
    # the same with micro-batches of one sample (batches of 2, chunks=2): there the LSTM's h of shape (1, 1, H) looks
    # like one sample, so the profile decides what may leave a stage on 2 samples, and the pipeline checks it on the
    # first two micro-batches joined
    lstm = nn.LSTM(FEATURES // 3, 8, batch_first=True)
    backbone = nn.Sequential(_Sequence(), lstm, _LastStep(), nn.Tanh(), nn.Linear(24, CLASSES))
    return Scenario(Base(backbone), train=DataLoader(_data(), batch_size=2))


class GroupsByPosition(Base):
    """Selects layers by position in ``configure_optimizers``, as on one device: the first layer frozen by index, a
    slice at one rate, and a rate per later layer found by iterating over the backbone."""

    def configure_optimizers(self) -> Any:
        self.backbone[0].requires_grad_(False)
        groups = [{"params": self.backbone[1:3].parameters(), "lr": 0.05}]
        for i, layer in enumerate(self.backbone):
            if i >= 3 and any(True for _ in layer.parameters()):
                groups.append({"params": layer.parameters(), "lr": 0.3 * 0.5 ** (len(self.backbone) - 1 - i)})
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def groups_by_position() -> Scenario:
    # each stage reads the other stages' layers as their meta copies while the optimizers are built, and drops their
    # parameters: the same groups on every stage (before: refused, "The backbone is partitioned over 2 stages")
    return Scenario(GroupsByPosition())


class GroupsByDepth(Base):
    """Layer-wise learning-rate decay, as fine-tuning recipes build it: a param group per depth, read from each
    parameter's name in ``named_parameters()``, at a base rate scaled by the model's size (``self.parameters()``)."""

    def configure_optimizers(self) -> Any:
        size = sum(p.numel() for p in self.parameters())  # the whole model's, as on one device
        depths: dict[int, list[Any]] = {}
        for name, p in self.named_parameters():
            depths.setdefault(int(name.split(".")[1]), []).append(p)
        top = max(depths)
        groups = [{"params": ps, "lr": 3.0 / size**0.5 * 0.6 ** (top - d)} for d, ps in sorted(depths.items())]
        return torch.optim.AdamW(groups, weight_decay=0.05)


def groups_by_depth() -> Scenario:
    # named_parameters() listed this stage's parameters alone: each stage built as many groups as it held depths
    # (refused: "different numbers of param groups"), and a rate scaled by the size counted one stage
    return Scenario(GroupsByDepth())


class NamedLayers(Base):
    """A backbone built from an ``OrderedDict``: param groups chosen by parameter name and by attribute, as one device
    selects them; the names every rank sees and the keys of the checkpoint it writes are recorded."""

    def __init__(self) -> None:
        super().__init__(
            nn.Sequential(
                OrderedDict(
                    embed=nn.Linear(FEATURES, 12),
                    act=nn.Tanh(),
                    hidden=nn.Linear(12, 12),
                    act2=nn.Tanh(),
                    head=nn.Linear(12, CLASSES),
                )
            )
        )

    def configure_optimizers(self) -> Any:
        head = list(self.backbone.head.parameters())  # another stage's layer reads here as its meta copy
        slow = [p for n, p in self.named_parameters() if n.startswith("backbone.embed.")]
        rest = [p for n, p in self.named_parameters() if not n.startswith(("backbone.embed.", "backbone.head."))]
        groups = [{"params": slow, "lr": 0.01}, {"params": head, "lr": 0.3}, {"params": rest}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)

    def on_train_start(self) -> None:
        self.record["names"] = [n for n, _ in self.named_parameters()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.trainer.is_global_zero:
            self.record["saved"] = list(checkpoint["state_dict"])


def named_layers() -> Scenario:
    # each stage registered its layers as "0", "1", ...: a group selected by name was empty on every stage, and those
    # parameters trained at the other group's rate (1.6e-2 off one device, silently); `backbone.head` was an
    # AttributeError, and a checkpoint's keys were not the one-device keys
    return Scenario(NamedLayers(), trainer={"enable_checkpointing": True})


class EndsEpochsEarly(Base):
    """Ends every epoch at its third batch: Lightning's ``on_train_batch_start`` returning -1."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        return -1 if batch_idx == 2 else None


def epoch_ended_by_the_hook() -> Scenario:
    return Scenario(EndsEpochsEarly())


def time_limit() -> Scenario:
    # Lightning's Timer decides on rank 0's clock and broadcasts the decision, so every stage stops after one step
    return Scenario(Base(), trainer={"max_time": {"seconds": 2}, "max_epochs": 10_000})


class OwnOptimizerHooks(Base):
    """The LightningModule's optimizer hooks overridden as Lightning's docs show them: ``optimizer_step`` runs the
    closure on every batch but steps on two of three (a step skipped), ``optimizer_zero_grad`` keeps zeroed tensors
    (``set_to_none=False``), and ``lr_scheduler_step`` steps a warm-up schedule on every second call only."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 3 == 2:
            optimizer_closure()  # the step and backward run; the optimizer does not step
        else:
            optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.record["scheduler_calls"] = self.record.get("scheduler_calls", 0) + 1
        if self.record["scheduler_calls"] % 2 == 0:
            scheduler.step()


def optimizer_hooks_overridden() -> Scenario:
    return Scenario(OwnOptimizerHooks())


class FineTunedInTwoPhases(Base):
    """Only the layers that require gradients are trained: a fine-tune that unfreezes between two fits."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)


def _unfreeze_and_fit_with_a_new_trainer(trainer: Any, module: Any, train: Any, val: Any) -> None:
    """A second ``Trainer`` of the same kind fits the same module object again, its first layer now unfrozen."""
    module.backbone[0].requires_grad_(True)
    frozen = module.backbone[0].weight.detach().clone()  # the whole model is back in the module after fit
    from lightning_gpipe import GPipeStrategy

    pipelined = isinstance(trainer.strategy, GPipeStrategy)
    strategy = GPipeStrategy(chunks=trainer.strategy.chunks) if pipelined else "auto"
    second = L.Trainer(
        accelerator="cpu",
        devices=len(trainer.device_ids),
        strategy=strategy,
        max_epochs=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    second.fit(module, train, val)
    moved = (module.backbone[0].weight.detach() - frozen).abs().max().item()
    module.record["second_fit"] = (second.global_step, second.current_epoch, moved > 0)


def second_trainer_after_unfreezing() -> Scenario:
    module = FineTunedInTwoPhases()
    module.backbone[0].requires_grad_(False)
    return Scenario(module, trainer={"max_epochs": 1}, after_fit=_unfreeze_and_fit_with_a_new_trainer)


def _files_written(trainer: L.Trainer, module: L.LightningModule, train: DataLoader, val: Any) -> None:
    """Every file in the checkpoint directory, read on the rank that wrote them (the directory is rank 0's)."""
    if not trainer.is_global_zero:
        return
    directory = trainer.checkpoint_callback.dirpath  # type: ignore[union-attr]
    assert directory is not None
    files = {}
    for name in sorted(os.listdir(directory)):
        saved = torch.load(os.path.join(directory, name), weights_only=True)
        files[name] = (saved["global_step"], saved["state_dict"])
    module.record["files"] = files


def async_checkpoint_io() -> Scenario:
    """Lightning's ``AsyncCheckpointIO``: the files are written in a thread, after ``save_checkpoint`` returned."""
    every = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)
    settings = {"enable_checkpointing": True, "plugins": [AsyncCheckpointIO()]}
    return Scenario(Base(), callbacks=[every], trainer=settings, after_fit=_files_written)


SCENARIOS = {
    f.__name__: f
    for f in (
        device_stats,
        simple_profiler,
        advanced_profiler,
        reloaded_every_epoch,
        loader_state_set_in_on_fit_start,
        combined_loader,
        two_validation_loaders,
        batch_transfer_hooks,
        deterministic_algorithms,
        without_inference_mode,
        own_sampler,
        log_rank_zero_only,
        min_epochs,
        barebones,
        one_cycle_schedule,
        iterable_dataset,
        sparse_batches,
        step_without_backbone,
        backbone_under_no_grad,
        saliency_from_its_own_call,
        saliency_in_manual_optimization,
        backward_inputs_stem,
        backward_inputs_head,
        frozen_backbone,
        frozen_last_layer,
        validation_every_two_steps,
        autocast_in_step,
        weights_loaded_in_on_fit_start,
        built_under_init_module,
        module_in_two_places,
        lstm_in_backbone,
        lstm_single_samples,
        groups_by_position,
        groups_by_depth,
        named_layers,
        time_limit,
        epoch_ended_by_the_hook,
        optimizer_hooks_overridden,
        second_trainer_after_unfreezing,
        async_checkpoint_io,
    )
}
