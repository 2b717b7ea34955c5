"""Ordinary Lightning code that used to hang or train silently wrong under a pipeline; each runs in K processes.

Every scenario ends in a failed ``fit`` on every rank (or, for SIGTERM, a stop of every rank at one step): the
tests check how fast and with what message.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import sys
import tempfile
import time
from typing import Any, Callable

import _models as M
import _sweeps
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


class SamplePredictions(Callback):
    """Logs a few predictions from rank zero only: common Lightning code that calls the model on one rank."""

    def __init__(self, hook: str, samples: int) -> None:
        self.samples = samples
        setattr(self, hook, self._predict)

    @rank_zero_only
    def _predict(self, trainer, pl_module, *args) -> None:
        x = torch.randn(self.samples, M.FEATURES)
        pl_module(x)


def _fit(model, devices, callbacks=(), data=None, **kwargs) -> None:
    from lightning_gpipe import GPipeStrategy

    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2), devices=devices, **M.trainer_kwargs(callbacks=list(callbacks), **kwargs)
    )
    trainer.fit(model, data if data is not None else M.loader())


def rank_zero_callback(rank: int, world_size: int, hook: str, samples: int) -> None:
    """A @rank_zero_only callback calls the model; with ModelCheckpoint, the other rank heads into its save."""
    L.seed_everything(0, verbose=False)
    callbacks = [SamplePredictions(hook, samples)]
    kwargs = {}
    if hook == "on_train_epoch_end":
        directory = os.environ["GPIPE_TEST_TMP"]
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="rank-zero-callback"))
        kwargs = dict(enable_checkpointing=True, max_steps=-1, max_epochs=1)
    _fit(M.Net(), world_size, callbacks, **kwargs)


def failing_stage_with_on_exception_checkpoint(rank: int, world_size: int, path: str) -> None:
    """Stage 1 raises at its third call while Lightning's OnExceptionCheckpoint is on."""
    L.seed_everything(0, verbose=False)
    model = M.Net()
    model.backbone.append(_sweeps.Boom(rank=1, call=3))
    _fit(
        model,
        world_size,
        [OnExceptionCheckpoint(os.path.dirname(path), os.path.basename(path)[:-5])],
        max_steps=20,
        enable_checkpointing=True,
    )


class _SignalsFromAWorker(Callback):
    """Writes each worker's pid to ``directory``; at the end of batch 2, stage 0's worker sends ``signum`` to the main
    process of the spawn launch alone, which is no rank (a ``kill -INT`` of the job's process), or to itself alone
    (``to_itself``: a scheduler's SIGTERM to a worker)."""

    def __init__(self, directory: str, signum: int, to_itself: bool) -> None:
        self.directory, self.signum, self.to_itself = directory, signum, to_itself

    def on_train_start(self, trainer, pl_module) -> None:
        with open(os.path.join(self.directory, f"pid{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 2 and trainer.global_rank == 0 and trainer.current_epoch == 0:
            os.kill(os.getpid() if self.to_itself else os.getppid(), self.signum)


def spawned(directory: str, how: str) -> None:
    """A fit of 1000 epochs that a script starts with ``start_method="spawn"``, with ``OnExceptionCheckpoint``, ended
    ``how``: ``"raises"``, stage 1 raises at its third call; ``"exits"``, stage 1 calls ``sys.exit(3)`` after its
    third batch; ``"main interrupted"``, the main process alone gets SIGINT;
    ``"worker terminated"``, stage 0's worker alone gets SIGTERM; ``"main terminated"``, the main process alone gets
    SIGTERM (a scheduler's, which signals the job's first process)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()
    callbacks: list[Callback] = [OnExceptionCheckpoint(os.path.join(directory, "ckpt"))]
    if how == "raises":
        model.backbone.append(_sweeps.Boom(rank=1, call=3))
    elif how == "exits":
        callbacks.append(_ExitsOnRankOne())
    else:
        signum = signal.SIGINT if how == "main interrupted" else signal.SIGTERM
        callbacks.append(_SignalsFromAWorker(directory, signum, to_itself=how == "worker terminated"))
    settings = M.trainer_kwargs(callbacks=callbacks, enable_checkpointing=True, max_steps=-1, max_epochs=1000)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2, start_method="spawn"), devices=2, **settings)
    trainer.fit(model, M.loader())


class _ExitsOnRankOne(Callback):
    """``sys.exit(3)`` on rank 1 after training batch 2: a user's script that gives up on one rank."""

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 3:
            sys.exit(3)


class MomentumEncoder(M.Net):
    """A target network: a copy of the backbone updated from it after every batch (BYOL, MoCo), by a zip over the two
    parameter lists. All its layers have one shape, so pairing a stage's parameters with the copy's first ones
    raises nothing in torch."""

    def __init__(self) -> None:
        super().__init__()
        width = M.FEATURES
        self.backbone = torch.nn.Sequential(
            *[layer for _ in range(3) for layer in (torch.nn.Linear(width, width), torch.nn.Tanh())]
        )
        self.head = torch.nn.Sequential(torch.nn.Linear(width, M.CLASSES))
        self.target = copy.deepcopy(self.backbone).requires_grad_(False)

    def on_train_batch_end(self, *args: object) -> None:
        with torch.no_grad():
            for online, target in zip(self.backbone.parameters(), self.target.parameters()):
                target.mul_(0.9).add_(online, alpha=0.1)


def momentum_encoder(rank: int, world_size: int) -> None:
    L.seed_everything(0, verbose=False)
    _fit(MomentumEncoder(), world_size, max_steps=4)


class NoisyDigits(Dataset):
    """Adds noise from a generator of its own, never seeded (Python seeds it from the OS): each process draws other
    numbers. The strategy makes the stages' global random states one, but cannot see a generator like this."""

    def __init__(self) -> None:
        self.data = M.dataset()
        self.random = random.Random()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        x, y = self.data[index]
        return x + self.random.random(), y


class PerRankStream(IterableDataset):
    """Yields a stream that depends on the global rank: sharded per process instead of per replica."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
        for _ in range(40):
            yield torch.randn(M.FEATURES, generator=generator), torch.randint(0, M.CLASSES, (), generator=generator)


class OnePassStream(IterableDataset):
    """A stream that can be read once (a generator over a pipe): ``__iter__`` returns the same iterator every time.
    The same samples on every rank; the default balance's profile takes rank 0's first batch at setup."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        samples = [(torch.randn(M.FEATURES, generator=generator), torch.randint(0, M.CLASSES, ())) for _ in range(40)]
        self.stream = iter(samples)

    def __iter__(self):
        return self.stream


class UnseededText(Dataset):
    """Words drawn by a generator of its own, never seeded, with fixed labels: each process reads other text."""

    def __init__(self) -> None:
        self.random = random.Random()

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int):
        return "".join(self.random.choice("abcdefgh") for _ in range(M.FEATURES)), index % M.CLASSES


class TextNet(M.Net):
    """Featurizes a batch of words inside ``training_step``: the loader's batch holds strings, not tensors."""

    def training_step(self, batch, batch_idx):
        words, y = batch
        x = torch.tensor([[ord(c) - ord("a") for c in word] for word in words], dtype=torch.float32)
        return super().training_step((x, y), batch_idx)


class Images:
    """A batch class of a user's (neither a container nor a dataclass), which Lightning moves through its ``to``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device: torch.device) -> "Images":
        return Images(self.x.to(device), self.y.to(device))


def _images(samples: list) -> Images:
    return Images(torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples]))


class ImagesNet(M.Net):
    """Takes its inputs from an :class:`Images` batch."""

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch.x), batch.y)
        self.log("train_loss", loss, batch_size=len(batch.y))
        return loss


def different_batches(rank: int, world_size: int, cause: str) -> None:
    """The stages get different batches: unseeded randomness, a per-rank stream or text, or a batch object. (Loaders of
    unequal lengths are refused before the first batch: ``loaders_of_other_lengths``.)"""
    L.seed_everything(0, verbose=False)
    random.seed(rank)  # another global stream on each rank: harmless, the stages take the first stage's
    if cause == "unseeded random":
        data = DataLoader(NoisyDigits(), batch_size=8)
    elif cause == "per-rank iterable":
        data = DataLoader(PerRankStream(), batch_size=8)
    elif cause == "one-pass stream":
        data = DataLoader(OnePassStream(), batch_size=8)
    elif cause == "unseeded text":
        _fit(TextNet(), world_size, data=DataLoader(UnseededText(), batch_size=8))
        return
    elif cause == "unseeded batch object":  # the fingerprint read only the class's name: it trained on, silently
        _fit(ImagesNet(), world_size, data=DataLoader(NoisyDigits(), batch_size=8, collate_fn=_images))
        return
    _fit(M.Net(), world_size, data=data, max_steps=-1, max_epochs=2)


class RateBySize(M.Net):
    """A learning rate scaled by the model's size, counted over ``self.parameters()`` once training starts: this
    rank's stage in a fit (inside ``configure_optimizers`` the count is the whole model's, as on one device)."""

    def on_train_start(self):
        size = sum(p.numel() for p in self.parameters())
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = 1.0 / size**0.5


class HalveRateOnRankZero(Callback):
    """Halves the learning rate after the first epoch, on rank zero only."""

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        for group in trainer.optimizers[0].param_groups:
            group["lr"] /= 2


def different_learning_rates(rank: int, world_size: int, cause: str) -> None:
    """The stages' learning rates differ from the start, or after the first epoch (of 5 batches)."""
    L.seed_everything(0, verbose=False)
    if cause == "rate by the model's size":
        _fit(RateBySize(), world_size)
    else:
        _fit(M.Net(), world_size, [HalveRateOnRankZero()], max_steps=-1, max_epochs=2)


class PenaltyOverParameters(M.Net):
    """An L2 penalty over ``self.parameters()`` added to the loss: during a fit, this rank's stage and the head.
    ``last_only``: in the last training step alone, so that only the check at the end of training can see it."""

    def __init__(self, last_only: bool, nan_on_rank_1: bool = False) -> None:
        super().__init__()
        self.last_only, self.nan_on_rank_1 = last_only, nan_on_rank_1

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.nan_on_rank_1:  # a term that only rank 1 computes as NaN (as a rank-dependent overflow does)
            return loss + (float("nan") if self.global_rank == 1 else 0.0)
        if not self.last_only or self.trainer.global_step == self.trainer.max_steps - 1:
            loss = loss + 1e-3 * sum(p.pow(2).sum() for p in self.parameters())
        return loss


class KeepsAuxiliary(torch.nn.Tanh):
    """A Tanh that keeps a term of its output for the loss, as a mixture-of-experts layer keeps its balancing loss."""

    def forward(self, x):
        out = super().forward(x)
        self.auxiliary = out.pow(2).mean()
        return out


class AuxiliaryFromTheBackbone(M.Net):
    """Adds the terms its backbone's Tanh layers kept (both Tanh: any split of two stages puts them apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone[1], self.backbone[5] = KeepsAuxiliary(), KeepsAuxiliary()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 1e-2 * sum(m.auxiliary for m in self.modules() if isinstance(m, KeepsAuxiliary))


class GradientPenalty(M.Net):
    """WGAN-GP's penalty on the norm of the backbone's input gradient, from a backbone call of its own, with
    ``create_graph=True``: its gradient for the backbone's weights comes from a backward of the backward."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        probe = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.backbone(probe).sum(), probe, create_graph=True)
        return super().training_step(batch, batch_idx) + ((grad.norm(dim=1) - 1) ** 2).mean()


def penalized_loss(rank: int, world_size: int, when: str) -> None:
    L.seed_everything(0, verbose=False)
    if when == "auxiliary":
        _fit(AuxiliaryFromTheBackbone(), world_size)
    elif when == "gradient penalty":
        _fit(GradientPenalty(), world_size)
    else:
        _fit(PenaltyOverParameters(last_only=when == "last step", nan_on_rank_1=when == "nan on rank 1"), world_size)


class DrawnAfterTheSplit(M.Net):
    """Draws the backbone's weights anew in ``hook``, which runs after the split (each stage holds its own layers).

    ``equal``: a backbone of two equal halves (each stage then draws the very same values); else the uneven
    :func:`_models.mlp`, whose stages draw unequal amounts."""

    def __init__(self, hook: str, equal: bool) -> None:
        super().__init__()
        if equal:  # a stem outside the backbone, then two stages of one Linear(8, 8) and a Tanh each
            self.stem = nn.Linear(M.FEATURES, 8)
            self.backbone = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.hook = hook
        setattr(self, hook, self._draw)

    def _draw(self) -> Any:
        self.apply(lambda m: nn.init.xavier_uniform_(m.weight) if isinstance(m, nn.Linear) else None)
        return super().configure_optimizers() if self.hook == "configure_optimizers" else None


def drawn_after_the_split(rank: int, world_size: int, hook: str, equal: bool) -> None:
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    balance = [2, 2] if equal else None
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2, balance=balance), devices=world_size, **M.trainer_kwargs())
    trainer.fit(DrawnAfterTheSplit(hook, equal), M.loader())


class LongerOnRankOne(IterableDataset):
    """The same samples on every rank, and 8 more on rank 1: a stream whose length differs per process."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(16 + (8 if self.rank == 1 else 0)):
            yield torch.randn(M.FEATURES, generator=g), int(torch.randint(0, M.CLASSES, (1,), generator=g))


def stream_of_another_length(rank: int, world_size: int) -> None:
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    strategy = GPipeStrategy(chunks=2, failure_timeout=3.0)
    trainer = L.Trainer(strategy=strategy, devices=world_size, **M.trainer_kwargs(max_steps=-1, max_epochs=2))
    trainer.fit(M.Net(), DataLoader(LongerOnRankOne(rank), batch_size=4))


class FirstOnRank(torch.utils.data.Sampler):
    """The first 40 samples in order on rank 0 and the first 32 on rank 1: the same batches while both last."""

    def __init__(self, rank: int) -> None:
        self.count = 40 if rank == 0 else 32

    def __iter__(self):
        return iter(range(self.count))

    def __len__(self) -> int:
        return self.count


class OtherLengthsFromEpochOne(M.Net):
    """Its loader is made anew every epoch: 40 samples on every rank in epoch 0, then ``FirstOnRank``'s (by global
    rank, or, ``by_replica``, by data-parallel replica: the stages of each pipeline alike)."""

    def __init__(self, by_replica: bool = False) -> None:
        super().__init__()
        self.by_replica = by_replica

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.strategy.distributed_sampler_kwargs["rank"] if self.by_replica else self.global_rank
        sampler = FirstOnRank(rank) if self.trainer.current_epoch > 0 else range(40)
        return DataLoader(M.dataset(40), batch_size=8, sampler=sampler)


def loaders_of_other_lengths(rank: int, world_size: int, which: str) -> None:
    """Rank 1's loader holds fewer batches than rank 0's: ``which`` is ``"training"`` (from the start), ``"reloaded"``
    (training, from epoch 1 on), ``"validation"`` or ``"predict"``; ``"reloaded by replica"``: replica 1's, from
    epoch 1 on (4 ranks: 2 replicas of 2 stages)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    reload = 1 if which.startswith("reloaded") else 0
    kwargs = M.trainer_kwargs(
        max_steps=-1, max_epochs=3, reload_dataloaders_every_n_epochs=reload, limit_val_batches=1.0
    )
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2, pipe_size=2), devices=world_size, **kwargs)
    shorter = DataLoader(M.dataset(40), batch_size=8, sampler=FirstOnRank(rank))
    if which.startswith("reloaded"):
        trainer.fit(OtherLengthsFromEpochOne(by_replica=which == "reloaded by replica"))
    elif which == "training":
        trainer.fit(M.Net(), shorter)
    elif which == "validation":
        trainer.validate(M.Net(), shorter)
    else:
        trainer.predict(M.Net(), shorter)


class LightningsGradNorm(M.Net):
    """Logs Lightning's ``grad_norm`` (of this rank's stage during a fit) from ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, optimizer) -> None:
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self, norm_type=2))


def stage_grad_norms(rank: int, world_size: int) -> None:
    L.seed_everything(0, verbose=False)
    _fit(LightningsGradNorm(), world_size)


class StopOnRankZero(Callback):
    """Sets ``trainer.should_stop`` from rank zero only, in ``hook``, at epoch ``epoch`` (batch ``batch``)."""

    def __init__(self, hook: str, epoch: int, batch: int = 2) -> None:
        self.epoch, self.batch = epoch, batch
        setattr(self, hook, self._stop)

    @rank_zero_only
    def _stop(self, trainer, pl_module, *args) -> None:
        batch_idx = args[-1] if args and isinstance(args[-1], int) else self.batch
        if trainer.current_epoch == self.epoch and batch_idx == self.batch and not trainer.sanity_checking:
            trainer.should_stop = True


class StateAtTrainEnd(Callback):
    """Asks for the model's state in ``on_train_end``, while the backbone is still partitioned, in the three ways
    a user might: the module's ``state_dict()``, the same for this stage on purpose, and the strategy's."""

    def on_train_end(self, trainer, pl_module) -> None:
        try:
            pl_module.state_dict()
            self.refused = None
        except RuntimeError as error:
            self.refused = str(error)
        with pl_module.backbone.stage_state():
            self.stage_keys = list(pl_module.state_dict())
        whole = trainer.strategy.lightning_module_state_dict()  # on every rank: it gathers
        self.whole = {k: v.detach().clone() for k, v in whole.items()}


#: Each hook of a rank-zero-only stop, and the epoch it stops in (5 batches an epoch, batch 2 for the first).
STOP_HOOKS = {"on_train_batch_end": 1, "on_validation_end": 1, "on_train_epoch_end": 0}


def stopped_fits(rank: int, world_size: int) -> dict:
    """One fit per hook of a rank-zero-only stop: steps, epochs and the whole trained backbone after each.

    One device with ``devices=1`` and no strategy when ``world_size`` is 1, else the pipeline, which then
    also tries each of ``REFUSED`` (its error, if refused, under its name).
    """
    from lightning_gpipe import GPipeStrategy

    records, state = [], StateAtTrainEnd()
    for hook, epoch in STOP_HOOKS.items():
        L.seed_everything(0, verbose=False)
        model = M.Net()
        strategy = GPipeStrategy(chunks=2) if world_size > 1 else "auto"
        trainer = L.Trainer(
            strategy=strategy,
            devices=world_size,
            **M.trainer_kwargs(
                callbacks=[StopOnRankZero(hook, epoch)] + ([state] if world_size > 1 and not records else []),
                max_steps=-1,
                max_epochs=3,
                limit_val_batches=2,
            ),
        )
        trainer.fit(model, M.loader(shuffle=False), M.loader(shuffle=False))
        records.append(
            {
                "hook": hook,
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "weights": {k: v.detach().clone() for k, v in model.backbone.state_dict().items()},
            }
        )
    refusals = {name: _refusal(attempt, world_size) for name, attempt in REFUSED.items()} if world_size > 1 else {}
    return {"stops": records, "state at train end": vars(state), **refusals}


def _refusal(attempt: Callable[[int], None], world_size: int) -> str | None:
    """The message of the ValueError that ``attempt(world_size)`` raised, or None if it ran."""
    try:
        attempt(world_size)
    except ValueError as error:
        return str(error)
    return None


def _pipelined(world_size: int, **settings) -> L.Trainer:
    from lightning_gpipe import GPipeStrategy

    return L.Trainer(strategy=GPipeStrategy(chunks=2), devices=world_size, **M.trainer_kwargs(**settings))


def _timed_validation(world_size: int) -> None:
    trainer = _pipelined(world_size, val_check_interval="00:00:00:05")
    trainer.fit(M.Net(), M.loader(shuffle=False), M.loader(shuffle=False))


def _batch_size_finder(world_size: int) -> None:
    from lightning.pytorch.tuner import Tuner

    Tuner(_pipelined(world_size)).scale_batch_size(WithBatchSize(), max_trials=2)


def _sync_batchnorm(world_size: int) -> None:
    model = M.Net()
    model.backbone.insert(1, torch.nn.BatchNorm1d(16))
    _pipelined(world_size, sync_batchnorm=True).fit(model, M.loader(shuffle=False))


def _sync_batchnorm_layers(world_size: int) -> None:
    model = M.Net()
    model.backbone.insert(1, torch.nn.BatchNorm1d(16))
    model.backbone = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model.backbone)  # a DDP script's line
    _pipelined(world_size).fit(model, M.loader(shuffle=False))


def _graph_logging(world_size: int) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger

    model = M.Net()
    model.example_input_array = torch.zeros(2, M.FEATURES)
    logger = TensorBoardLogger(tempfile.mkdtemp(), log_graph=True)
    _pipelined(world_size, logger=logger).fit(model, M.loader(shuffle=False))


def _stage_sharded_sampler(world_size: int) -> None:
    data = M.loader(shuffle=False).dataset  # a DDP script's loader: its sampler's defaults count the stages
    _pipelined(world_size).fit(M.Net(), DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False)))


#: What each rank would do its own way, tried on the pipeline: each must be refused at setup (the message).
REFUSED: dict[str, Callable[[int], None]] = {
    "timed validation": _timed_validation,
    "batch size finder": _batch_size_finder,
    "sync batchnorm": _sync_batchnorm,
    "sync batchnorm layers": _sync_batchnorm_layers,
    "graph logging": _graph_logging,
    "sampler over the stages": _stage_sharded_sampler,
}


class WithBatchSize(M.Net):
    """A module whose ``batch_size`` the batch size finder may change (it builds its own loader)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 8

    def train_dataloader(self):
        return M.loader(batch_size=self.batch_size, shuffle=False)


class SaveOnRankZero(Callback):
    """Saves a checkpoint from rank zero only, at the end of the first epoch: every rank must call it."""

    def __init__(self, path: str) -> None:
        self.path = path

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


class StopInTheModuleOnRankZero(M.Net):
    """Sets ``trainer.should_stop`` on rank zero only, from the LightningModule's own hook."""

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if batch_idx == 2 and self.global_rank == 0:
            self.trainer.should_stop = True


class ClipOnRankZero(M.Net):
    """Clips with torch's ``clip_grad_norm_`` on rank zero only: the norm is every stage's, so rank 0 waits."""

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.global_rank == 0:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)


def deadlocked(rank: int, world_size: int, cause: str, path: str) -> None:
    """Rank 0 heads into a call that rank 1 never makes, while rank 1 waits elsewhere; found after 3 s."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = {"module stop": StopInTheModuleOnRankZero, "rank-zero clip": ClipOnRankZero}.get(cause, M.Net)()
    callbacks = [SaveOnRankZero(path)] if cause == "rank-zero save" else []
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2, failure_timeout=3.0),
        devices=world_size,
        **M.trainer_kwargs(callbacks=callbacks, max_steps=-1, max_epochs=2),
    )
    trainer.fit(model, M.loader(shuffle=False))


class SequenceFirst(L.LightningModule):
    """A Transformer layer built sequence-first (torch's default) and given ``(sequence, batch, features)``."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.backbone = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), layer, nn.Linear(8, M.CLASSES))

    def training_step(self, batch, batch_idx):
        x, y = batch
        sequence = x.view(len(x), 3, 2).transpose(0, 1)  # (3 positions, batch, 2): the cut falls across positions
        return nn.functional.cross_entropy(self.backbone(sequence).mean(0), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def sequence_first_fit(rank: int, world_size: int, check: bool) -> None:
    """Trains :class:`SequenceFirst` at K=2 with the Transformer layer on stage 1 (3 positions: micro-batches of 2
    and 1), with the per-sample check on or off."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    strategy = GPipeStrategy(chunks=2, balance=[2, 2], check_per_sample=check)
    L.Trainer(strategy=strategy, devices=world_size, **M.trainer_kwargs(max_steps=2)).fit(SequenceFirst(), M.loader())


def terminated(ranks: list[int], directory: str, signum: int = signal.SIGTERM) -> None:
    """A fit under Lightning's popen launcher, with OnExceptionCheckpoint, that ``signum`` (SIGTERM, or SIGINT: a
    Ctrl-C) ends at batch 2 of epoch 0."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    callbacks = [SignalAt(signum, ranks, 2), OnExceptionCheckpoint(directory)]
    settings = M.trainer_kwargs(callbacks=callbacks, enable_checkpointing=True, max_steps=-1, max_epochs=20)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=2, **settings)
    try:
        trainer.fit(M.Net(), M.loader())
    finally:
        print(f"rank {trainer.global_rank} stopped after step {trainer.global_step}", flush=True)


class StuckOnRankOne(M.Net):
    """Rank 1's ``training_step`` of batch 2 never returns (a user's hang: a wait for a file, an endless loop)."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 1:
            time.sleep(600)
        return super().training_step(batch, batch_idx)


def stuck(directory: str, frozen: bool = False) -> None:
    """A fit under Lightning's popen launcher whose rank 1 hangs in its step (``frozen``: stops itself); each rank
    writes its pid first."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2, failure_timeout=3.0, watchdog_grace=1.0),
        devices=2,
        **M.trainer_kwargs(max_steps=6),
    )
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    with open(os.path.join(directory, f"pid{rank}"), "w") as file:
        file.write(str(os.getpid()))
    trainer.fit(FrozenOnRankOne() if frozen else StuckOnRankOne(), M.loader())


class FrozenOnRankOne(M.Net):
    """Rank 1 stops itself (SIGSTOP) in ``training_step`` of batch 2: frozen, it runs no watchdog of its own."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().training_step(batch, batch_idx)


class AbortsOnRankOne(Callback):
    """Rank 1 dies in native code after training batch 2 (``os.abort``: as gloo's abort on a mismatched collective)."""

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 3:
            os.abort()


class RaisesOnOneSample(nn.Module):
    def forward(self, x):
        if self.training and x.shape[0] == 1:
            raise ValueError("boom on one sample")
        return x


class LastStageRaises(L.LightningModule):
    """A layer of the last stage raises on the first micro-batch of one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), RaisesOnOneSample(), nn.Linear(8, 3))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.backbone(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def last_stage_raises(rank: int, world_size: int) -> None:
    """Micro-batches of one sample, so that stage 0 still sends when stage 1's layer raises and its process ends."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=GPipeStrategy(balance=[2, 3], chunks=16), devices=world_size, **M.trainer_kwargs())
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    trainer.fit(LastStageRaises(), DataLoader(data, batch_size=16))


class FailsToPredict(M.Net):
    def predict_step(self, batch, batch_idx):
        raise ValueError(f"boom in predict on rank {self.global_rank}")


def caught_failure(status: str) -> None:
    """A fit, then a predict that fails on every rank, under Lightning's popen launcher; the script catches the
    failure, says so, then ends normally (``status="normal"``) or with ``sys.exit(3)``."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=2, **M.trainer_kwargs(max_steps=1))
    model = FailsToPredict()
    trainer.fit(model, M.loader())
    try:
        trainer.predict(model, M.loader(shuffle=False))
    except Exception as error:
        print(f"caught on rank {trainer.global_rank}: {type(error).__name__}", flush=True)
    if status == "exit 3":
        sys.exit(3)


def aborted() -> None:
    """A fit under Lightning's popen launcher whose rank 1 aborts."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    callbacks = [AbortsOnRankOne()]
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2), devices=2, **M.trainer_kwargs(callbacks=callbacks, max_steps=6)
    )
    trainer.fit(M.Net(), M.loader())


class SignalAt(Callback):
    """Sends ``signum`` to its own process on ``ranks`` (a scheduler's signal reaches every process; a ``kill`` may
    reach one): at the end of training batch ``batch``; with ``forward``, on rank 0, from inside the backbone's first
    layer during that batch's forward instead (wherever the signal finds the process); or at the end of the
    ``validation``-th validation batch of the run (counted over its validations)."""

    def __init__(
        self, signum: int, ranks: list[int], batch: int = -1, forward: bool = False, validation: int = 0
    ) -> None:
        self.signum, self.ranks, self.batch, self.forward, self.validation = signum, ranks, batch, forward, validation
        self.sent, self.validated = False, 0

    def _send(self) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.forward and batch_idx == self.batch and trainer.global_rank == 0 and 0 in self.ranks:
            # stage 0 holds the layer: the signal comes in the middle of the first micro-batch's forward
            def send(*args: Any) -> None:
                self._send()
                handle.remove()

            handle = pl_module.backbone[0].register_forward_hook(send)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        in_forward = self.forward and trainer.global_rank == 0  # sent during the batch already
        if batch_idx == self.batch and trainer.global_rank in self.ranks and not in_forward:
            self._send()

    def on_validation_batch_end(self, trainer, *args: Any) -> None:
        self.validated += 1
        if self.validated == self.validation and trainer.global_rank in self.ranks:
            self._send()


def on_slurm(rank: int, world_size: int, directory: str) -> None:
    """This process as ``srun`` starts a task of a 1-node job, with a ``scontrol`` that writes down its arguments."""
    tools = os.path.join(directory, "bin")
    os.makedirs(tools, exist_ok=True)
    with open(os.path.join(tools, "scontrol"), "w") as script:
        script.write(f'#!/bin/sh\necho "$@" >> {os.path.join(directory, "scontrol.log")}\n')
    os.chmod(os.path.join(tools, "scontrol"), 0o755)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)  # torchrun's, which Lightning would take first; the main address and port stay
    os.environ.update(
        SLURM_NTASKS=str(world_size),
        SLURM_NTASKS_PER_NODE=str(world_size),
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NODEID="0",
        SLURM_NNODES="1",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train",
        SLURM_NODELIST="127.0.0.1",
        PATH=tools + os.pathsep + os.environ.get("PATH", ""),
    )


def requeued(rank: int, world_size: int, directory: str, signaled: list[int], forward: bool) -> dict:
    """An Adam fit of 6 steps of 2 accumulated batches on SLURM (auto-requeue, Lightning's default there) whose
    requeue signal reaches ``signaled`` during training batch 2, the first of a step's two; without ``signaled``,
    the relaunch, which resumes from the HPC checkpoint. Then, on a first run, a ``validate`` whose signal comes at
    validation batch 1 of stage 1."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_gpipe import GPipeStrategy

    on_slurm(rank, world_size, directory)
    L.seed_everything(0, verbose=False)
    model = M.Net(optimizer="adam")
    callbacks = [SignalAt(signal.SIGUSR1, signaled, 2, forward)] if signaled else []
    settings = M.trainer_kwargs(callbacks=callbacks, max_steps=6, default_root_dir=directory, accumulate_grad_batches=2)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2, balance=[3, 4]), devices=world_size, **settings)
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    trainer.fit(model, M.loader())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    if signaled:
        validating = L.Trainer(
            strategy=GPipeStrategy(chunks=2, balance=[3, 4]),
            devices=world_size,
            **M.trainer_kwargs(
                callbacks=[SignalAt(signal.SIGUSR1, [1], validation=2)], default_root_dir=directory, limit_val_batches=3
            ),
        )
        validating.validate(model, M.loader(shuffle=False))
    return {"weights": weights, "steps": trainer.global_step, "ran": len(model.losses)}


class _InterruptAtTrainEnd(Callback):
    """Sends SIGINT (a Ctrl-C) to stage 1's process in ``on_train_end``, after the run's last batch."""

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGINT)


def interrupted_after_the_last_batch(rank: int, world_size: int) -> dict:
    """A fit of 3 steps whose stage 1 gets SIGINT in ``on_train_end``; what the fit did and what the rank said."""
    import logging

    from lightning_gpipe import GPipeStrategy

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch").addHandler(handler)
    settings = M.trainer_kwargs(callbacks=[_InterruptAtTrainEnd()], max_steps=3)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=world_size, **settings)
    trainer.fit(M.Net(), M.loader())
    return {"steps": trainer.global_step, "said": said, "handler": signal.getsignal(signal.SIGINT)}


def terminated_in_validation(rank: int, world_size: int, directory: str, signaled: bool, resume: bool) -> dict:
    """An Adam fit of 3 epochs of 5 batches, validated every 2 batches over 3 batches, with ``OnExceptionCheckpoint``:
    ``signaled``, SIGTERM comes to stage 1 at the end of the second validation's second batch, and then, in a
    ``validate``, at its second batch; ``resume``, the fit goes on from the checkpoint the first wrote."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model, path = M.Net(optimizer="adam"), os.path.join(directory, "on_exception.ckpt")
    callbacks: list[Callback] = [OnExceptionCheckpoint(directory)]
    if signaled:
        callbacks.append(SignalAt(signal.SIGTERM, [1], validation=5))
    settings = M.trainer_kwargs(
        callbacks=callbacks, max_steps=-1, max_epochs=3, limit_val_batches=3, enable_checkpointing=True
    )
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2),
        devices=world_size,
        val_check_interval=2,
        default_root_dir=directory,
        **settings,
    )
    outcome: dict[str, Any] = {}
    try:
        trainer.fit(model, M.loader(), M.loader(shuffle=False), ckpt_path=path if resume else None)
    except SystemExit as stop:
        outcome["fit"] = f"{type(stop).__name__} at step {trainer.global_step}"
    outcome["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    if signaled:
        sender = SignalAt(signal.SIGTERM, [1], validation=2)
        settings = M.trainer_kwargs(callbacks=[sender], limit_val_batches=4)
        validating = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=world_size, **settings)
        try:
            validating.validate(model, M.loader(shuffle=False))
        except SystemExit as stop:
            outcome["validate"] = f"{type(stop).__name__} after {sender.validated} batches"
    return outcome


class LogsInputs(M.Net):
    """A validation that does not call the backbone (it logs a statistic of the inputs)."""

    def validation_step(self, batch, batch_idx):
        self.log("mean_input", batch[0].mean())


class Stream(IterableDataset):
    """``samples`` samples as a stream, whose length the loader cannot tell (the batch counts are not compared)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __iter__(self):
        return iter(M.dataset(self.samples))


def validations_of_different_lengths(rank: int, world_size: int) -> None:
    """A fit whose validation stream holds 5 batches on rank 0 and 3 on the others; no backbone call in it. (Loaders
    of known lengths are refused at the validation's start, see ``loaders_of_other_lengths``.)"""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    settings = M.trainer_kwargs(limit_val_batches=None, use_distributed_sampler=False)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=world_size, **settings)
    trainer.fit(LogsInputs(), M.loader(), DataLoader(Stream(40 if rank == 0 else 24), batch_size=8))


def rank_zero_collective_between_runs(rank: int, world_size: int, then: str) -> None:
    """After ``fit``, rank 0 alone reads ``trainer.log_dir`` (Lightning broadcasts it), then every rank validates, or
    fits with a new Trainer: rank 1's run waits for a rank 0 that is still in the broadcast."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()

    def trainer() -> L.Trainer:
        strategy = GPipeStrategy(chunks=2, failure_timeout=3.0, watchdog_grace=1.0)
        return L.Trainer(strategy=strategy, devices=world_size, **M.trainer_kwargs(max_steps=2))

    first = trainer()
    first.fit(model, M.loader())
    if first.global_rank == 0:
        print(first.log_dir)
    if then == "validate":
        first.validate(model, M.loader(), verbose=False)
    else:  # a new Trainer's strategy forms its process groups first
        trainer().fit(M.Net(), M.loader())


def saves_after_fit(path: str, ranks: str) -> None:
    """A fit under Lightning's popen launcher, then ``trainer.save_checkpoint(path)`` after ``fit`` returned, on every
    rank (``ranks="every"``) or, as one-device habits write it, under ``if trainer.is_global_zero:``."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=2, **M.trainer_kwargs(max_steps=2))
    trainer.fit(M.Net(), M.loader())
    if ranks == "every" or trainer.is_global_zero:
        trainer.save_checkpoint(path)
    print(f"rank {trainer.global_rank} done", flush=True)


def exits_on_rank_one() -> None:
    """A fit under Lightning's popen launcher whose rank 1 calls ``sys.exit(3)`` after batch 2 (``_ExitsOnRankOne``)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    settings = M.trainer_kwargs(callbacks=[_ExitsOnRankOne()], max_steps=-1, max_epochs=1000)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=2, **settings)
    trainer.fit(M.Net(), M.loader())


class _TeardownFails(M.Net):
    """Its ``teardown`` hook raises on global rank ``rank``: Lightning calls it after the strategy's teardown, last in
    ``fit``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.failing_rank = rank

    def teardown(self, stage: str) -> None:
        if self.trainer.global_rank == self.failing_rank:
            raise RuntimeError(f"the teardown hook fails on rank {self.failing_rank}")


def fails_in_teardown_hook(rank: int) -> None:
    """A fit over 3 stages under Lightning's popen launcher whose module's ``teardown`` hook raises on ``rank``."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=3, **M.trainer_kwargs())
    trainer.fit(_TeardownFails(rank), M.loader())
    print(f"fit returned on rank {trainer.global_rank}", flush=True)


class _KillsItself(Callback):
    """SIGKILL to its own process on global rank ``rank`` before the backward of training batch 2 (the out-of-memory
    killer's way)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_before_backward(self, trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def killed_replica(rank: int, world_size: int) -> None:
    """Two data-parallel replicas of a two-stage pipeline (4 ranks); rank 2, stage 0 of replica 1, is killed before
    its backward of batch 2, so its replica partner (rank 0) loses it in the average of the gradients."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    strategy = GPipeStrategy(chunks=2, pipe_size=2, failure_timeout=5.0)
    settings = M.trainer_kwargs(callbacks=[_KillsItself(2)], max_steps=-1, max_epochs=1000)
    L.Trainer(strategy=strategy, devices=world_size, **settings).fit(M.Net(), M.loader())
