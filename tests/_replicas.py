"""Workers for the data-parallel tests: 2 replicas of a 2-stage pipeline, and pipe_size=1 against DDP."""

from __future__ import annotations

import os
import warnings
from typing import Any

import _models as M
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_gpipe.checkpointing.model_state import meta_state_allowed

STEPS, BATCH = 5, 8  # per replica; 20 samples a replica: batches of 8, 8, 4, so 5 steps cross an epoch


def _fit(
    strategy: Any,
    devices: int,
    max_steps: int = STEPS,
    ckpt_path: str | None = None,
    save_every: int = 0,
    directory: str = "",
    tied: bool = False,
    batch_norm: bool = False,
    trainer_options: dict[str, Any] | None = None,
    **model: Any,
) -> dict[str, Any]:
    """``batch_norm``: a BatchNorm in a stem outside the backbone and one first in it; ``trainer_options`` with
    validation settings: a validation loader too."""
    L.seed_everything(0, verbose=False)
    net = M.TiedNet(**model) if tied else M.Net(**model)
    if batch_norm:
        net.stem = torch.nn.Sequential(torch.nn.Linear(M.FEATURES, M.FEATURES), torch.nn.BatchNorm1d(M.FEATURES))
        net.backbone.insert(0, torch.nn.BatchNorm1d(M.FEATURES))
    callbacks = (
        [ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=save_every, save_top_k=-1)]
        if save_every
        else []
    )
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        **M.trainer_kwargs(
            max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(callbacks), **(trainer_options or {})
        ),
    )
    validation = M.loader(batch_size=BATCH, shuffle=False) if trainer_options else None
    trainer.fit(net, M.loader(batch_size=BATCH), validation)
    if ckpt_path is not None:
        raise AssertionError("use _resume")
    return {
        "weights": _state(net),
        "grads": {k: v.clone() for k, v in net.first_grads.items()},
        "losses": list(net.losses),
        "logged": float(trainer.callback_metrics["train_loss"]),
    }


def _resume(strategy: Any, devices: int, ckpt_path: str, max_steps: int, **model: Any) -> dict[str, Any]:
    L.seed_everything(1, verbose=False)
    net = M.Net(**model)
    trainer = L.Trainer(strategy=strategy, devices=devices, **M.trainer_kwargs(max_steps=max_steps))
    trainer.fit(net, M.loader(batch_size=BATCH), ckpt_path=ckpt_path)
    return {"weights": _state(net)}


class CountsValidated(M.Net):
    """Counts the validation samples it sees in a torchmetrics ``SumMetric``, logged at the epoch's end."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.seen = torchmetrics.SumMetric()

    def validation_step(self, batch, batch_idx):
        self.seen.update(torch.tensor(float(len(batch[1]))))
        self.log("seen", self.seen, on_epoch=True)


def validated_by_ddp_after_a_pipelined_fit() -> tuple[float, float]:
    """A module fitted by the pipeline (2 replicas of 2 stages), then validated by DDP over the same 4 processes, then
    by one device in each: the samples its metric counted in each (40 and 40, as DDP alone and one device count)."""
    from lightning_gpipe import GPipeStrategy

    net = CountsValidated()
    L.Trainer(strategy=GPipeStrategy(pipe_size=2, chunks=2), devices=4, **M.trainer_kwargs(max_steps=1)).fit(
        net, M.loader(batch_size=BATCH)
    )
    loader = M.loader(batch_size=BATCH, shuffle=False)
    trainer = L.Trainer(strategy=DDPStrategy(), devices=4, **M.trainer_kwargs(limit_val_batches=None))
    over_ddp = float(trainer.validate(net, loader, verbose=False)[0]["seen"])
    trainer = L.Trainer(devices=1, **M.trainer_kwargs(limit_val_batches=None))
    return over_ddp, float(trainer.validate(net, loader, verbose=False)[0]["seen"])


def replicas(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    def gpipe(**kwargs: Any) -> GPipeStrategy:
        return GPipeStrategy(**{"pipe_size": 2, "chunks": 2, **kwargs})

    out: dict[str, Any] = {"2x2": _fit(gpipe(), 4, sync_dist=True)}
    # both ties of the tied backbone span the two stages: summed over the stages, averaged over the replicas
    out["2x2 tied"] = _fit(gpipe(balance=[3, 4]), 4, tied=True, optimizer="adam")
    # parameters no replica has a gradient for keep .grad = None (AdamW would decay them with a zero one): stage 0
    # behind a stop-gradient; the whole tied backbone behind a detached output
    out["2x2 stop gradient"] = _fit(gpipe(balance=[2, 6]), 4, stop_gradient=True, stem=True, optimizer="adamw")
    out["2x2 tied, output detached"] = _fit(gpipe(balance=[3, 4]), 4, tied=True, optimizer="adamw", detach_output=True)
    trainer = L.Trainer(strategy=gpipe(), devices=4, **M.trainer_kwargs(max_steps=1))
    trainer.fit(M.Net(), M.loader(batch_size=BATCH))
    out["sum over replicas"] = float(trainer.strategy.reduce(torch.tensor(float(rank)), reduce_op="sum"))
    out["written"] = os.path.join(directory, "written")  # Lightning's documented writer, on every rank
    os.makedirs(out["written"], exist_ok=True)
    trainer.callbacks.append(M.Writer(out["written"], "epoch"))
    trainer.predict(trainer.lightning_module, M.loader(batch_size=BATCH, shuffle=False))
    out["first stage"] = trainer.strategy.layout.stage_of(rank) == 0
    out["pipe_size=1"] = _fit(GPipeStrategy(pipe_size=1, chunks=2), 4, optimizer="adam")
    out["ddp"] = _fit(DDPStrategy(), 4, optimizer="adam")
    out["ddp validates after the pipeline"] = validated_by_ddp_after_a_pipelined_fit()
    # BatchNorm outside the backbone and in it: each replica's data moved its running statistics apart, where DDP
    # gives every rank rank 0's (broadcast_buffers); a validation every 2 steps and accumulation over 2 batches follow
    # DDP's rule of when it broadcasts
    options = dict(val_check_interval=2, accumulate_grad_batches=2, limit_val_batches=2, num_sanity_val_steps=1)
    batch_norm = dict(batch_norm=True, optimizer="sgd", max_steps=3, trainer_options=options)
    out["pipe_size=1 batch norm"] = _fit(GPipeStrategy(pipe_size=1, chunks=1), 4, **batch_norm)
    out["ddp batch norm"] = _fit(DDPStrategy(), 4, **batch_norm)
    for kind in ("full", "sharded"):
        where = os.path.join(directory, kind)
        out[f"straight {kind}"] = _fit(gpipe(), 4, max_steps=8, optimizer="adam", dropout=0.2)
        _fit(gpipe(state_dict_type=kind), 4, max_steps=3, save_every=3, directory=where, optimizer="adam", dropout=0.2)
        out[f"resumed {kind}"] = _resume(
            gpipe(state_dict_type=kind), 4, os.path.join(where, "step=3.ckpt"), 8, optimizer="adam", dropout=0.2
        )
    out["files"] = {kind: sorted(os.listdir(os.path.join(directory, kind))) for kind in ("full", "sharded")}
    # replica 1 is given another file (as `ckpt_path="best"` gives where each replica's monitored value is its own):
    # every rank must load rank 0's, as DDP's model holds rank 0's weights, or the replicas would train apart
    other = os.path.join(directory, "other")
    _fit(gpipe(), 4, max_steps=2, save_every=2, directory=other, optimizer="adam", dropout=0.2)
    given = os.path.join(directory, "full", "step=3.ckpt") if rank < 2 else os.path.join(other, "step=2.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["resumed, replica 1 given another file"] = _resume(gpipe(), 4, given, 8, optimizer="adam", dropout=0.2)
    out["other file warnings"] = [str(w.message) for w in caught if "rank loads rank 0's" in str(w.message)]
    # sparse gradients cannot join the replicas' dense buckets: refused before any batch, by the engine (a sparse
    # embedding in the backbone) and by the strategy (one outside it, which the replicas average too)
    from lightning_gpipe import GPipe, PipeLayout

    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 3))
    model = M.Net()
    model.lookup = torch.nn.Embedding(10, 4, sparse=True)
    for name, build in (
        ("sparse engine", lambda: GPipe(sparse, [1, 2], layout=PipeLayout(4, 2))),
        ("sparse strategy", lambda: _fit_module(model, gpipe())),
    ):
        try:
            build()
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    return out


def _fit_module(model: L.LightningModule, strategy: Any) -> None:
    L.Trainer(strategy=strategy, devices=4, **M.trainer_kwargs(max_steps=1)).fit(model, M.loader(batch_size=BATCH))


def global_batches(replica_count: int = 2) -> list[list[int]]:
    """The samples of each step of the 2 x 2 run, both replicas together: what one device must see."""
    dataset = M.dataset()
    steps: list[list[int]] = []
    epoch = 0
    while len(steps) < STEPS:
        per_replica = []
        for r in range(replica_count):
            sampler = DistributedSampler(dataset, num_replicas=replica_count, rank=r, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            per_replica.append(list(BatchSampler(sampler, BATCH, drop_last=False)))
        steps += [sum(batches, []) for batches in zip(*per_replica)]
        epoch += 1
    return steps[:STEPS]


def one_device_on_the_global_batch(tied: bool = False, **model: Any) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    net = M.TiedNet(**model) if tied else M.Net(**model)
    loader = DataLoader(M.dataset(), batch_sampler=global_batches())
    trainer = L.Trainer(devices=1, **M.trainer_kwargs(max_steps=STEPS))
    trainer.fit(net, loader)
    return {
        "weights": _state(net),
        "grads": {k: v.clone() for k, v in net.first_grads.items()},
        "losses": list(net.losses),
    }


def _state(net) -> dict:
    """What this process holds (after a sharded run, the other stages' layers on meta: read on purpose)."""
    with meta_state_allowed():
        return {k: v.clone() for k, v in net.state_dict().items()}


def uneven_evaluation(rank: int, world_size: int, stage: str) -> None:
    """``predict`` or ``validate`` over 2 replicas of 2 stages on 17 samples in batches of 8, replica 0 getting 9
    samples (2 batches) and replica 1 8 (1 batch): Lightning's predict sampler does not pad; for ``validate``, the
    user's own sharding by replica (``use_distributed_sampler=False``)."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    options = M.trainer_kwargs(limit_val_batches=None, use_distributed_sampler=stage == "predict")
    trainer = L.Trainer(strategy=GPipeStrategy(pipe_size=2, chunks=2), devices=world_size, **options)
    data = M.loader(batch_size=BATCH, samples=17, shuffle=False)
    if stage == "validate":
        replica = trainer.strategy.distributed_sampler_kwargs["rank"]
        shard = torch.utils.data.Subset(data.dataset, range(replica, 17, 2))
        data = torch.utils.data.DataLoader(shard, batch_size=BATCH)
    getattr(trainer, stage)(M.Net(), data)
