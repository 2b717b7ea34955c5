"""A LightningModule with skips and BatchNorm in its backbone: fit, save and resume re-partitioned, under Lightning."""

from __future__ import annotations

import os
from typing import Any

import _batchnorm_workers as B
import _models as M
import _skip_workers as S
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_gpipe import PopCat, Stash

#: Splits of the backbone: the fit crosses both skips over the boundary; the resume keeps "a" on stage 0.
FIT_BALANCE, RESUME_BALANCE = [3, 5], [5, 3]
FIT_STEPS, STEPS = 3, 5


class SkipNet(M.Net):
    """``_models.Net`` whose backbone holds a skip over three layers, a concatenating skip and two BatchNorms."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            S.Mix(M.FEATURES, stashes=["a"]),
            nn.BatchNorm1d(S.WIDTH),
            Stash("b"),
            S.Mix(S.WIDTH),
            S.Mix(S.WIDTH, pops=["a"]),
            nn.BatchNorm1d(S.WIDTH),
            PopCat("b"),
            nn.Linear(2 * S.WIDTH, 8),
        )


def fit(strategy: Any, devices: int, steps: int, ckpt_path: Any = None, callbacks: Any = ()) -> tuple[L.Trainer, dict]:
    """``steps`` optimizer steps on the tiled batches (deferred BatchNorm then equals one device's)."""
    L.seed_everything(0, verbose=False)
    model = SkipNet()
    kwargs = M.trainer_kwargs(max_steps=steps, enable_checkpointing=bool(callbacks))
    trainer = L.Trainer(strategy=strategy, devices=devices, callbacks=list(callbacks), **kwargs)
    trainer.fit(model, B.tiled_loader(), ckpt_path=ckpt_path)
    record = {
        "losses": list(model.losses),
        "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }
    return trainer, record


def pipelined(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Fit 3 steps on [3, 5] with the monitor and save; resume to step 5 on [5, 3]."""
    from lightning_gpipe import GPipeStrategy, PipelineMonitor

    monitor = PipelineMonitor(dirpath=directory)  # its trace goes to the test's directory, not the working one
    saver = ModelCheckpoint(directory, "skips", every_n_train_steps=FIT_STEPS, save_top_k=-1)  # while the pipe runs
    strategy = GPipeStrategy(chunks=B.CHUNKS, deferred_batch_norm=True, balance=FIT_BALANCE)
    trainer, first = fit(strategy, world_size, FIT_STEPS, callbacks=[monitor, saver])
    path = os.path.join(directory, "skips.ckpt")
    try:  # after the run, as a one-device script saves its final model
        after_fit = os.path.join(directory, "after.ckpt")
        trainer.save_checkpoint(after_fit)
    except RuntimeError as error:
        after_fit = str(error)
    trainer.save_checkpoint(os.path.join(directory, "weights.ckpt"), weights_only=True)
    strategy = GPipeStrategy(chunks=B.CHUNKS, deferred_batch_norm=True, balance=RESUME_BALANCE)
    _, resumed = fit(strategy, world_size, STEPS, ckpt_path=path)
    return {
        "first": first,
        "resumed": resumed,
        "monitor": monitor.summary,
        "checkpoint": path,
        "after fit": after_fit,
        "weights only": os.path.join(directory, "weights.ckpt"),
    }


def one_device(steps: int, ckpt_path: Any = None, save_to: Any = None) -> dict[str, Any]:
    """The same training with Lightning's default strategy and plain BatchNorm, without the pipeline; with
    ``save_to``, it saves a checkpoint there after ``FIT_STEPS`` as the pipelined fit does."""
    callbacks = [ModelCheckpoint(save_to, "skips", every_n_train_steps=FIT_STEPS, save_top_k=-1)] if save_to else []
    return fit("auto", 1, steps, ckpt_path=ckpt_path, callbacks=callbacks)[1]
