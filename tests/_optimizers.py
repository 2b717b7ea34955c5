"""Workers for the optimizer tests: stages with nothing to train, param groups added while training, refusals.

Each scenario is one function of ``pipeline``: with ``False`` it is the one-device run with Lightning's
default strategy (the reference, run in the test process), with ``True`` the same run on a pipeline of
2 stages (run in the spawned workers, all scenarios in one spawn: :func:`everything`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import _models as M
import lightning as L
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, ModelCheckpoint
from torch import nn
from torch.nn.utils import clip_grad_value_  # bound before any pipeline exists, as a script binds it

from lightning_gpipe.checkpointing.model_state import meta_state_allowed

#: Stage 0 holds layers 0-2 of the backbone (two Linear layers), stage 1 layers 3-6.
BALANCE = [3, 4]
#: 5 batches an epoch. :func:`picky` runs 8 steps; its checkpoint is the one at the end of the first epoch.
STEPS, SAVE_STEP = 8, 5
#: BackboneFinetuning adds the backbone to the optimizer at the start of epoch 1; checkpoints after epochs 0 and 1.
EPOCHS, UNFREEZE = 4, 1


class Steps(Callback):
    """Counts the training batches that started on this rank."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.count += 1


class Picky(M.Net):
    """:class:`Net` whose optimizer is given part of the model only.

    ``select``:
    - ``"frozen"``: a frozen feature extractor: layers 0 and 2 (all of stage 0) ``requires_grad_(False)``
      and no head, so stage 0 has nothing to train; Adam over the parameters that require grad, a StepLR.
    - ``"frozen-value"``: the same, clipped by value: by the Trainer and by torch's ``clip_grad_value_`` in a hook
      (bound by a ``from`` import), each of which stopped the run on the stage without gradients.
    - ``"subset"``: SGD with momentum over ``backbone.6`` only (held by stage 1; the head is not trained).
    - ``"nothing"``: every parameter frozen: the optimizer gets nothing, on any stage (one device refuses).
    - ``"lbfgs"``, ``"lbfgs-wolfe"``: LBFGS over every parameter, without and with a line search.
    """

    def __init__(self, select: str) -> None:
        super().__init__()
        self.select = select
        if select.startswith("frozen"):
            self.head = nn.Identity()  # the backbone's 8 outputs are the logits
            for layer in (self.backbone[0], self.backbone[2]):
                layer.requires_grad_(False)
        if select == "nothing":
            self.requires_grad_(False)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.select == "frozen-value":
            clip_grad_value_(self.parameters(), 0.02)

    def configure_optimizers(self):
        trainable = filter(lambda p: p.requires_grad, self.parameters())
        if self.select.startswith("frozen"):
            optimizer = torch.optim.Adam(trainable, lr=0.05)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}
        if self.select == "subset":
            chosen = [p for n, p in self.named_parameters() if n.startswith("backbone.6")]
            return torch.optim.SGD(chosen, lr=0.1, momentum=0.9)
        if self.select == "nothing":
            return torch.optim.SGD(trainable, lr=0.1)
        search = "strong_wolfe" if self.select == "lbfgs-wolfe" else None
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5, line_search_fn=search)


class Finetuned(M.Net):
    """:class:`Net` for BackboneFinetuning: Adam over what requires grad (the head, until the callback adds the
    backbone). At each epoch's start it records the names in each param group and which parameters require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[dict[str, Any]] = []

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)

    def on_train_epoch_start(self) -> None:  # Lightning runs it after the callbacks' (which add the group)
        names = {id(p): n for n, p in self.named_parameters()}
        optimizer = self.trainer.optimizers[0]
        self.epochs.append(
            {
                "groups": [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups],
                "lrs": [g["lr"] for g in optimizer.param_groups],
                "requires_grad": {n: p.requires_grad for n, p in self.named_parameters()},
            }
        )


def _trainer(
    pipeline: bool,
    devices: int,
    callbacks: list[Callback],
    balance: list[int] = BALANCE,
    state_dict_type: str = "full",
    pipe_size: int | None = None,
    **kwargs: Any,
) -> L.Trainer:
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    kwargs = M.trainer_kwargs(callbacks=list(callbacks), enable_checkpointing=saves, **kwargs)
    if not pipeline:
        return L.Trainer(devices=1, **kwargs)
    from lightning_gpipe import GPipeStrategy

    if pipe_size == 1 or devices == 1:
        balance = [sum(BALANCE)]  # one stage
    strategy = GPipeStrategy(balance=balance, chunks=2, state_dict_type=state_dict_type, pipe_size=pipe_size)
    return L.Trainer(strategy=strategy, devices=devices, **kwargs)


def _weights(model: L.LightningModule) -> dict[str, torch.Tensor | None]:
    """The trained weights; ``None`` for another stage's layers after a sharded run (they stay on ``meta``)."""
    with meta_state_allowed():  # the meta entries on purpose: outside, the state_dict of a sharded run refuses
        return {k: None if v.is_meta else v.detach().cpu().clone() for k, v in model.state_dict().items()}


def picky(
    select: str,
    pipeline: bool,
    devices: int = 1,
    max_steps: int = STEPS,
    ckpt_path: str | None = None,
    save_dir: str = "",
) -> dict[str, Any]:
    """Train a :class:`Picky` with norm clipping; ``save_dir`` keeps the checkpoint of step :data:`SAVE_STEP`."""
    L.seed_everything(0, verbose=False)
    model = Picky(select)
    saver = [ModelCheckpoint(dirpath=save_dir, filename="{step}", every_n_train_steps=SAVE_STEP)] if save_dir else []
    clip = {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"} if select == "frozen-value" else {}
    trainer = _trainer(pipeline, devices, saver, max_steps=max_steps, **{"gradient_clip_val": 0.5, **clip})
    trainer.fit(model, M.loader(shuffle=False), ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    return {
        "weights": _weights(model),
        "losses": list(model.losses),
        "local group sizes": [len(g["params"]) for g in optimizer.param_groups],
        "lrs": [g["lr"] for g in optimizer.param_groups],
    }


def finetune(
    pipeline: bool,
    devices: int = 1,
    epochs: int = EPOCHS,
    ckpt_path: str | None = None,
    save_dir: str = "",
    state_dict_type: str = "full",
) -> dict[str, Any]:
    """Train a :class:`Finetuned` with BackboneFinetuning; ``save_dir`` keeps a checkpoint after every epoch."""
    L.seed_everything(0, verbose=False)
    model = Finetuned()
    callbacks: list[Callback] = [BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE, lambda_func=lambda e: 1.5)]
    if save_dir:
        callbacks.append(ModelCheckpoint(dirpath=save_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1))
    trainer = _trainer(pipeline, devices, callbacks, state_dict_type=state_dict_type, max_steps=-1, max_epochs=epochs)
    trainer.fit(model, M.loader(shuffle=False), ckpt_path=ckpt_path)
    return {"weights": _weights(model), "losses": list(model.losses), "epochs": model.epochs}


def one_device_files(directory: str) -> None:
    """The one-device checkpoints that the pipeline resumes from (and compares its own files with)."""
    picky("frozen", pipeline=False, max_steps=SAVE_STEP, save_dir=os.path.join(directory, "one", "frozen"))
    finetune(pipeline=False, epochs=2, save_dir=os.path.join(directory, "one", "finetune"))


def finetune_sources(directory: str) -> dict[str, str]:
    """The BackboneFinetuning checkpoints that a pipeline resumes from, by name (the sharded one is a directory)."""
    paths = {
        f"{source} {epoch}": os.path.join(directory, source, "finetune", f"epoch={epoch}.ckpt")
        for source in ("pipe", "one")
        for epoch in (0, 1)
    }
    paths["pipe sharded 1"] = os.path.join(directory, "pipe", "finetune-sharded", "epoch=1.ckpt")
    return paths


def resumed_dir(directory: str, source: str) -> str:
    """Where the pipeline's run resumed from ``source`` (a name of :func:`finetune_sources`) keeps its checkpoints."""
    return os.path.join(directory, "pipe", "finetune-from", source.replace(" ", "-"))


def everything(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Every scenario on ``world_size`` stages, in one spawn.

    First what must train as on one device (writing the pipeline's checkpoints), then what must be refused
    at setup; the refused runs end the processes with exit code 1 after this returns (by design: see
    ``failure.exit_without_finalizers``).
    """
    pipe = os.path.join(directory, "pipe")
    out: dict[str, Any] = {}
    for select in ("frozen", "subset", "frozen-value"):
        out[select] = picky(select, True, world_size)
    picky("frozen", True, world_size, max_steps=SAVE_STEP, save_dir=os.path.join(pipe, "frozen"))
    for source in ("pipe", "one"):
        path = os.path.join(directory, source, "frozen", f"step={SAVE_STEP}.ckpt")
        out[f"frozen from {source}"] = picky("frozen", True, world_size, ckpt_path=path)
    out["finetune"] = finetune(True, world_size)
    finetune(True, world_size, epochs=2, save_dir=os.path.join(pipe, "finetune"))
    finetune(True, world_size, epochs=2, save_dir=os.path.join(pipe, "finetune-sharded"), state_dict_type="sharded")
    for name, path in finetune_sources(directory).items():
        out[f"finetune from {name}"] = finetune(
            True,
            world_size,
            ckpt_path=path,
            save_dir=resumed_dir(directory, name),
            state_dict_type="sharded" if "sharded" in name else "full",
        )
    out["refused"] = refused(world_size)
    return out


def refused(world_size: int) -> dict[str, Any]:
    """Each configuration that must be refused at setup: the error, how long the fit took, batches started."""
    out: dict[str, Any] = {}
    for select in ("lbfgs", "lbfgs-wolfe", "nothing"):
        out[select] = _refusal(Picky(select), world_size)
    # a last stage without parameters (a ReLU): BackboneFinetuning would add a param group on stage 0 only
    model = Finetuned()
    model.backbone.append(nn.ReLU())
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE)
    out["finetuning, a stage without parameters"] = _refusal(model, world_size, [callback], balance=[7, 1])
    # 2 data-parallel replicas of a 1-stage pipeline: the backbone, frozen when the pipeline is built, would
    # not be averaged over the replicas once unfrozen
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=UNFREEZE)
    out["finetuning, data-parallel replicas"] = _refusal(Finetuned(), world_size, [callback], pipe_size=1)
    return out


def _refusal(model: L.LightningModule, devices: int, callbacks: Sequence[Callback] = (), **kwargs: Any) -> dict:
    steps = Steps()
    trainer = _trainer(True, devices, [*callbacks, steps], max_steps=5, **kwargs)
    start = time.monotonic()
    try:
        trainer.fit(model, M.loader(shuffle=False))
        error = None
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    return {"error": error, "seconds": time.monotonic() - start, "batches": steps.count}
