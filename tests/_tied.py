"""Workers for the tied-weights tests: every configuration of one K in one spawn."""

from __future__ import annotations

import os
from typing import Any

import _models as M
import lightning as L
import torch
from _sweeps import Config
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary

#: Splits of the 7-layer tied backbone: with K=2 both ties span stages 0 and 1; with K=3 the weight
#: tie spans stages 0 and 2 (first and last) and the bias tie stages 1 and 2 (two holder groups).
BALANCE = {2: [3, 4], 3: [2, 2, 3]}

CONFIGS = [
    Config("sgd", strategy=(("chunks", 2),)),
    Config(
        "adam checkpoint=always", model=(("optimizer", "adam"),), strategy=(("chunks", 3), ("checkpoint", "always"))
    ),
    Config(
        "sgd accumulation and clipping",
        strategy=(("chunks", 2),),
        trainer=(("accumulate_grad_batches", 2), ("gradient_clip_val", 0.05)),
    ),
    Config(
        "adam manual, two backward passes a step, clipping",
        model=(("optimizer", "adam"), ("manual", True)),
        strategy=(("chunks", 2),),
    ),
]
#: A tie's copies listed once, under the one-device name, while ``configure_optimizers`` runs: groups chosen by name
#: (before: the last stage put its copy, listed as `backbone.6.weight`, in the other group, which was refused).
BY_NAME = Config("adamw, no decay by name on a tie", model=(("optimizer", "adamw-by-name"),), strategy=(("chunks", 2),))
SAME_LAYER = Config("same layer twice on one stage", model=(("same_layer_twice", True),), strategy=(("chunks", 2),))
RESUME_DATA = dict(shuffle=False)
#: The checkpoint of the resume tests: after 3 of the epoch's 5 batches (mid-epoch).
SAVE = dict(max_steps=3, enable_checkpointing=True)


class _Copies(L.Callback):
    """What each stage holds at the start of training: its tied names and where its parameters live."""

    def on_train_start(self, trainer, pl_module) -> None:
        pipe = trainer.strategy.pipe
        self.names = pipe.tied_names()
        self.devices = {n: p.device.type for n, p in pl_module.named_parameters()}


def fit(config: Config, devices: int, data: dict | None = None, **trainer: Any) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    balance = [4, 2] if devices == 2 and dict(config.model).get("same_layer_twice") else BALANCE[devices]
    L.seed_everything(0, verbose=False)
    model = M.TiedNet(**dict(config.model))
    copies = _Copies()
    kwargs = M.trainer_kwargs(**{**dict(config.trainer), **trainer})
    kwargs["callbacks"] = [copies, *kwargs.get("callbacks", [])]
    record = M.fit_record(
        model,
        L.Trainer(strategy=GPipeStrategy(balance=balance, **dict(config.strategy)), devices=devices, **kwargs),
        M.loader(**(data or {})),
    )
    tied = (
        (model.backbone[1] is model.backbone[3])
        if dict(config.model).get("same_layer_twice")
        else M.is_tied(model.backbone)
    )
    record.update(tied_after_fit=tied, names=copies.names, devices=copies.devices)
    return record


def reference(config: Config, data: dict | None = None, **trainer: Any) -> dict[str, Any]:
    """The same run on one device, with Lightning's default strategy and without this package."""
    L.seed_everything(0, verbose=False)
    model = M.TiedNet(**dict(config.model))
    trainer_ = L.Trainer(devices=1, **M.trainer_kwargs(**{**dict(config.trainer), **trainer}))
    return M.fit_record(model, trainer_, M.loader(**(data or {})))


def one_device_checkpoint(directory: str) -> str:
    """The K=2 checkpoint's run on one device, without this package: what the pipeline's file must equal."""
    L.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(dirpath=directory, filename="one-device", every_n_train_steps=3)
    trainer = L.Trainer(devices=1, **M.trainer_kwargs(callbacks=[saver], **SAVE))
    trainer.fit(M.TiedNet(optimizer="adam"), M.loader(**RESUME_DATA))
    return os.path.join(directory, "one-device.ckpt")


def _summary(devices: int) -> int:
    from lightning_gpipe import GPipeStrategy

    seen: list[int] = []

    class Recording(ModelSummary):
        @staticmethod
        def summarize(summary_data, total_parameters, *args, **kwargs):
            seen.append(total_parameters)

    trainer = L.Trainer(
        strategy=GPipeStrategy(balance=BALANCE[devices]),
        devices=devices,
        **M.trainer_kwargs(max_steps=1, enable_model_summary=True, callbacks=[Recording()]),
    )
    trainer.fit(M.TiedNet(), M.loader())
    return seen[0] if seen else -1  # printed on rank 0 only


def sweep(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Every configuration; K=2 also writes a checkpoint after one epoch, K=3 resumes it."""
    results: dict[str, Any] = {c.name: fit(c, world_size) for c in [*CONFIGS, BY_NAME]}
    adam = Config("adam", model=(("optimizer", "adam"),), strategy=(("chunks", 2),))
    path = os.path.join(directory, "tied.ckpt")
    if world_size == 2:
        results[SAME_LAYER.name] = fit(SAME_LAYER, 2)
        saver = ModelCheckpoint(dirpath=directory, filename="tied", every_n_train_steps=3)
        fit(adam, 2, RESUME_DATA, callbacks=[saver], **SAVE)
        results["checkpoint"] = path
    else:
        results["resumed"] = _resume(adam, world_size, path)
        results["summary"] = _summary(world_size)
    return results


def _resume(config: Config, devices: int, path: str) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(1, verbose=False)
    model = M.TiedNet(**dict(config.model))
    trainer = L.Trainer(
        strategy=GPipeStrategy(balance=BALANCE[devices], **dict(config.strategy)), devices=devices, **M.trainer_kwargs()
    )
    trainer.fit(model, M.loader(**RESUME_DATA), ckpt_path=path)
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "tied": M.is_tied(model.backbone),
    }


class NudgeTheLastCopy(L.Callback):
    """Moves the tie's copy on the last stage (layer 6) before the second batch, on that stage only: the copies
    then differ although every stage holds the same optimizer settings (which the stages compare)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1 and trainer.global_rank == trainer.world_size - 1:
            with torch.no_grad():
                pl_module.backbone[6].weight.add_(0.01)


def diverging(rank: int, world_size: int) -> None:
    """A fit in which the tie's copy on the last stage moves on its own: must raise."""
    fit(Config("nudged", strategy=(("chunks", 2),)), world_size, callbacks=[NudgeTheLastCopy()])
