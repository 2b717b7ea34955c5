"""Workers for the checkpoint tests: stop, save, resume, re-partition, and fail while saving."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import _models as M
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_gpipe.checkpointing.model_state import meta_state_allowed

STEPS = 8  # 5 batches an epoch: runs cross an epoch boundary
RANDOM = {"dropout": 0.3, "head_dropout": 0.2, "scheduler": True}  # dropout in and outside the pipe, a scheduler


def _trainer(devices: int, strategy: dict, max_steps: int, callbacks=(), **kwargs) -> L.Trainer:
    from lightning_gpipe import GPipeStrategy

    return L.Trainer(
        strategy=GPipeStrategy(**{"chunks": 2, **strategy}),
        devices=devices,
        **M.trainer_kwargs(
            max_steps=max_steps, callbacks=list(callbacks), enable_checkpointing=bool(callbacks), **kwargs
        ),
    )


def _weights(model: L.LightningModule) -> dict[str, torch.Tensor]:
    """What this process holds (after a sharded run, the other stages' layers on meta: read on purpose)."""
    with meta_state_allowed():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(
    devices: int,
    optimizer: str,
    shuffle: bool = True,
    strategy: dict | None = None,
    random: bool = True,
    max_steps: int = STEPS,
    ckpt_path: str | None = None,
    save_every: int = 0,
    directory: str = "",
    seed: int = 0,
    frozen: bool = False,
    estimate_steps: bool = False,
    whole_at_end: bool = False,
) -> dict[str, Any]:
    """Train (or resume) and return the weights; ``save_every`` keeps a checkpoint every that many steps.

    ``frozen``: the first layer's weight gets no gradient (so Adam keeps no state for it). ``warned``:
    the strategy's warnings about random streams. ``whole_at_end``: also what the strategy's
    ``lightning_module_state_dict()`` gave in ``on_train_end``, while the backbone was still partitioned.
    """
    L.seed_everything(seed, verbose=False)
    model = M.Net(optimizer, **(RANDOM if random else {}))
    model.estimate_steps = estimate_steps
    if frozen:
        model.backbone[0].weight.requires_grad_(False)
    callbacks = []
    if save_every:
        callbacks.append(
            ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=save_every, save_top_k=-1)
        )
    whole = WholeStateAtTrainEnd()
    if whole_at_end:
        callbacks.append(whole)
    # with max_epochs the estimate counts the training batches, setting the training data up then (else: max_steps)
    trainer = _trainer(devices, strategy or {}, max_steps, callbacks, **({"max_epochs": 2} if estimate_steps else {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, M.loader(shuffle=shuffle), ckpt_path=ckpt_path)
    try:
        model.state_dict()
        refused = None
    except RuntimeError as error:  # after a sharded run: this process holds one stage, the rest on meta
        refused = str(error)
    return {
        "weights": _weights(model),
        "state_dict refused": refused,
        "whole at end": whole.state,
        "losses": list(model.losses),
        "warned": [str(w.message) for w in caught if "random streams" in str(w.message)],
    }


class WholeStateAtTrainEnd(Callback):
    """Keeps what ``trainer.strategy.lightning_module_state_dict()`` gives in ``on_train_end`` (on every rank)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.state = {k: v.detach().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


def save_for_repartition(rank: int, world_size: int, directory: str) -> dict[str, dict[str, Any]]:
    """K stages write step-3 checkpoints (mid-epoch), full and sharded, for another K to resume; per kind, whether
    the model's ``state_dict()`` after the run refused (its message), and the strategy's state_dict at its end."""
    out = {}
    for kind in ("full", "sharded"):
        result = run(
            world_size,
            "adam",
            strategy={"state_dict_type": kind},
            max_steps=3,
            save_every=3,
            directory=os.path.join(directory, f"{kind}-k{world_size}"),
            whole_at_end=True,
        )
        out[kind] = {"refused": result["state_dict refused"], "whole": result["whole at end"]}
    return out


def resume_everything(rank: int, world_size: int, directory: str, one_device_ckpt: str) -> dict[str, Any]:
    """On K stages: uninterrupted runs, then stop-and-resume at mid-epoch and epoch-end, same and other K."""
    out: dict[str, Any] = {}
    for optimizer in ("sgd", "adam"):
        out[f"straight {optimizer}"] = run(world_size, optimizer)
        for stop in (3, 5):
            where = os.path.join(directory, f"{optimizer}-{stop}")
            run(world_size, optimizer, max_steps=stop, save_every=stop, directory=where)
            # a different seed: everything that matters must come from the checkpoint
            out[f"resumed {optimizer} at {stop}"] = run(
                world_size, optimizer, seed=1, ckpt_path=os.path.join(where, f"step={stop}.ckpt")
            )
        out[f"resumed {optimizer} at 3 reading the estimated steps"] = run(
            world_size,
            optimizer,
            seed=1,
            ckpt_path=os.path.join(directory, f"{optimizer}-3", "step=3.ckpt"),
            estimate_steps=True,
        )
    for kind in ("full", "sharded"):
        path = os.path.join(directory, f"{kind}-k3", "step=3.ckpt")
        out[f"from k3 {kind}"] = run(
            world_size, "adam", seed=1, ckpt_path=path, strategy={"state_dict_type": kind, "balance": [3, 6]}
        )
    # another chunks and an explicit other seed: the dropout masks change, which rank 0 says once
    out["other chunks and seed"] = run(
        world_size,
        "adam",
        seed=1,
        ckpt_path=os.path.join(directory, "adam-3", "step=3.ckpt"),
        strategy={"chunks": 4, "seed": 5},
    )
    for optimizer, frozen in (("sgd-plain", False), ("adam", True)):  # parameters without optimizer state
        where = os.path.join(directory, f"no-state-{optimizer}")
        out[f"no state {optimizer} straight"] = run(world_size, optimizer, frozen=frozen)
        run(
            world_size,
            optimizer,
            frozen=frozen,
            max_steps=3,
            save_every=3,
            directory=where,
            strategy={"state_dict_type": "sharded"},
        )
        path = os.path.join(where, "step=3.ckpt")
        out[f"no state {optimizer} resumed"] = run(world_size, optimizer, frozen=frozen, seed=1, ckpt_path=path)
        if rank == 0:
            from lightning_gpipe.checkpointing.files import consolidate

            saved = consolidate(path)["optimizer_states"][0]  # numbered; DCP drops an empty state dict
            names = [name for group in saved["param_groups"] for name in group["param_names"]]
            out[f"no state {optimizer} saved"] = sorted(names[i] for i in saved["state"])
    out["from one device"] = run(world_size, "adam", shuffle=False, random=False, seed=1, ckpt_path=one_device_ckpt)
    for kind in ("full", "sharded"):
        where = os.path.join(directory, f"for-one-device-{kind}")
        strategy = {"state_dict_type": kind}
        run(
            world_size,
            "adam",
            shuffle=False,
            random=False,
            max_steps=5,
            save_every=5,
            directory=where,
            strategy=strategy,
        )
        out[f"for one device {kind}"] = os.path.join(where, "step=5.ckpt")
    return out


def mismatched_resumes(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Resume the 3-stage checkpoints into models whose backbone has one layer more, or one less.

    Every case must fail alike on every rank; the failed runs end the process with exit code 1 (at
    exit, by design: see ``failure.exit_without_finalizers``), after this function returns.
    """
    import torch.nn as nn

    out: dict[str, Any] = {}
    variants = {
        "one more layer": lambda b: b.append(nn.Linear(8, 8)),
        "one layer fewer": lambda b: b.__delitem__(1),
    }  # every later layer's index shifts
    for kind in ("full", "sharded"):
        path = os.path.join(directory, f"{kind}-k3", "step=3.ckpt")
        for name, change in variants.items():
            L.seed_everything(0, verbose=False)
            model = M.Net("adam", **RANDOM)
            change(model.backbone)
            try:
                _trainer(world_size, {}, STEPS).fit(model, M.loader(), ckpt_path=path)
                out[f"{kind} {name}"] = None
            except RuntimeError as error:
                out[f"{kind} {name}"] = str(error)
        # strict_loading=False loads the entries that match (here: all but the new layer)
        L.seed_everything(0, verbose=False)
        model = M.Net("adam", **RANDOM)
        model.backbone.append(nn.Linear(8, 8))
        model.strict_loading = False
        trainer = _trainer(world_size, {}, STEPS, limit_val_batches=1)
        trainer.validate(model, M.loader(shuffle=False), ckpt_path=path, verbose=False)
        out[f"{kind} not strict"] = _weights(model)
    return out


def fit_validate_from_last_fit_again(devices: int, directory: str) -> dict[str, torch.Tensor]:
    """One epoch, ``validate(ckpt_path="last")``, then a second epoch on the same Trainer, on shuffled data; the
    weights (chunks=2 and no dropout: the pipeline must give one device's)."""
    L.seed_everything(0, verbose=False)
    model = M.Net("adam")
    save = ModelCheckpoint(dirpath=directory, save_last=True)
    settings = M.trainer_kwargs(
        max_steps=-1, max_epochs=1, callbacks=[save], enable_checkpointing=True, limit_val_batches=None
    )
    if devices > 1:
        from lightning_gpipe import GPipeStrategy

        trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=devices, **settings)
    else:
        trainer = L.Trainer(devices=1, **settings)
    trainer.fit(model, M.loader())
    trainer.validate(model, M.loader(shuffle=False), ckpt_path="last", verbose=False)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, M.loader())
    return _weights(model)


def go_on_after_a_fit(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """A script's usual sequel to ``fit`` on the same module: ``validate`` (also from ``ckpt_path="last"``),
    ``predict`` and a second ``fit`` with a new Trainer, after a full run and after a sharded one (where each
    process holds its own stage only); then, on the sharded run's module, a run that asks for another split."""
    from lightning_gpipe.engine.failure import PipelineError

    out: dict[str, Any] = {}
    for kind in ("full", "sharded"):
        L.seed_everything(0, verbose=False)
        model = M.Net("adam", **RANDOM)
        where = os.path.join(directory, f"go-on-{kind}")
        save = ModelCheckpoint(dirpath=where, save_last=True)
        strategy = {"state_dict_type": kind}
        trainer = _trainer(world_size, strategy, max_steps=3, callbacks=[save], limit_val_batches=None)
        trainer.fit(model, M.loader())
        validated = trainer.validate(model, M.loader(shuffle=False), verbose=False)
        predicted = torch.cat(trainer.predict(model, M.loader(shuffle=False)))
        from_last = trainer.validate(model, M.loader(shuffle=False), ckpt_path="last", verbose=False)
        _trainer(world_size, strategy, max_steps=3).fit(model, M.loader())
        out[kind] = {
            "validated": validated,
            "from last": from_last,
            "predicted": predicted,
            "weights": _weights(model),
        }
    out["validated from last, fit again"] = fit_validate_from_last_fit_again(world_size, os.path.join(directory, "v"))
    try:
        _trainer(world_size, {"balance": [1, 6]}, max_steps=1, limit_val_batches=None).validate(
            model, M.loader(shuffle=False), verbose=False
        )
        out["refused"] = None
    except (ValueError, PipelineError) as error:
        out["refused"] = str(error)
    return out


def one_device(
    optimizer: str,
    max_steps: int,
    ckpt_path: str | None = None,
    save_every: int = 0,
    directory: str = "",
    seed: int = 0,
) -> dict[str, Any]:
    """The same training with Lightning's default strategy, without this package's strategy."""
    L.seed_everything(seed, verbose=False)
    model = M.Net(optimizer)
    callbacks = (
        [ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=save_every, save_top_k=-1)]
        if save_every
        else []
    )
    trainer = L.Trainer(
        devices=1, **M.trainer_kwargs(max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(callbacks))
    )
    trainer.fit(model, M.loader(shuffle=False), ckpt_path=ckpt_path)
    return {"weights": _weights(model)}


# -- failures ------------------------------------------------------------------------------------------------


class Sabotage(torch.nn.Module):
    """At its third call on ``rank``: kill the process, or freeze it (SIGSTOP), mid-step."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__()
        self.rank, self.how, self.calls = rank, how, 0

    def forward(self, x):
        self.calls += 1
        if int(os.environ["RANK"]) == self.rank and self.calls == 3:
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)
        return x


def sabotaged_fit(rank: int, world_size: int, victim: int, how: str) -> None:
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()
    balance = [2, 3, 2][:world_size] if world_size == 3 else [4, 3]
    model.backbone.insert(sum(balance[: victim + 1]), Sabotage(victim, how))
    balance[victim] += 1
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2, balance=balance, failure_timeout=3.0, watchdog_grace=2.0),
        devices=world_size,
        **M.trainer_kwargs(max_steps=20),
    )
    trainer.fit(model, M.loader())


class CrashingIO(TorchCheckpointIO):
    """Writes half of the second checkpoint, then the process dies: a crash during a save."""

    saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        CrashingIO.saves += 1
        if CrashingIO.saves == 2:
            with open(path, "wb") as f:
                f.write(b"half a checkpoint")
            os._exit(1)
        super().save_checkpoint(checkpoint, path, storage_options)


def crash_while_saving(rank: int, world_size: int, directory: str) -> None:
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    callback = ModelCheckpoint(dirpath=directory, filename="last", every_n_train_steps=2, enable_version_counter=False)
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2, failure_timeout=5.0, watchdog_grace=2.0),
        devices=world_size,
        plugins=[CrashingIO()],
        **M.trainer_kwargs(max_steps=6, callbacks=[callback], enable_checkpointing=True),
    )
    trainer.fit(M.Net(), M.loader())
