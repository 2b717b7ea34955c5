"""Workers for `test_grad_scaler.py`: float16 mixed precision with a GradScaler, pipelined and on one device."""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 12
#: the inputs' scale: large enough that the first layer's float16 weight gradients overflow at the first scales,
#: while the later layers, behind Tanh, stay finite; so the infs are found on stage 0 alone
INPUT_SCALE = 300.0


class Net(L.LightningModule):
    """A 5-layer MLP, each step recording the loss scale and whether this rank's own gradients held an inf."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
        self.scales: list[float] = []
        self.own_infs: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.backbone(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # after the scaler's unscale_: an overflow left infs in the gradients of the stage where it happened
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.own_infs.append(not all(bool(torch.isfinite(g).all()) for g in grads))

    def on_train_batch_end(self, *args: Any) -> None:
        self.scales.append(float(self.trainer.precision_plugin.scaler.get_scale()))  # type: ignore[attr-defined]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class HalveScaleOnRankZero(Callback):
    """Sets the loss scale on rank 0 only, after training batch 2 (a `@rank_zero_only` callback)."""

    @rank_zero_only
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            scaler = trainer.precision_plugin.scaler  # type: ignore[attr-defined]
            scaler.update(scaler.get_scale() / 2)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 6, generator=g) * INPUT_SCALE
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (96,), generator=g)), batch_size=8)


def fit(
    devices: Optional[int],
    chunks: int = 1,
    callbacks: tuple = (),
    steps: int = STEPS,
    name: str = "",
    resume: Optional[str] = None,
) -> dict[str, Any]:
    """``devices=None``: one device without this package; else the gpipe strategy on ``devices`` processes. Norm
    clipping at 5 (after the scaler's unscale_, so with the infs in the gradients on the steps it skips).

    The checkpoint written after the last step, ``<name>.ckpt``, is read back: its loss-scale entry, under the
    precision plugin's class name, as one device keys it. ``resume``: the checkpoint to resume from."""
    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    directory = tempfile.mkdtemp() if devices is None else os.environ["GPIPE_TEST_TMP"]
    name = name or f"fp16-{chunks}"
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=steps,
        gradient_clip_val=5.0,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=directory, filename=name, every_n_train_steps=steps)] + list(callbacks),
    )
    if devices is None:
        trainer = L.Trainer(devices=1, **kwargs)
    else:
        from lightning_gpipe import GPipeStrategy

        trainer = L.Trainer(strategy=GPipeStrategy(chunks=chunks), devices=devices, **kwargs)
    trainer.fit(model, _loader(), ckpt_path=resume)
    saved = torch.load(os.path.join(directory, f"{name}.ckpt"), weights_only=False)
    return {
        "scales": model.scales,
        "own_infs": model.own_infs,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "saved scaler": saved.get("MixedPrecision"),
    }


def references(rank: int, world_size: int) -> dict[str, Any]:
    """One device, and a pipeline of one stage with ``chunks=4``."""
    return {"one device": fit(None), "K=1, chunks=4": fit(1, chunks=4)}


def pipelined(rank: int, world_size: int) -> dict[str, Any]:
    """``chunks`` 1 and 4, and the first run again in two halves: stopped after step 6 (mid-epoch), then resumed."""
    runs = {"chunks=1": fit(world_size, chunks=1), "chunks=4": fit(world_size, chunks=4)}
    fit(world_size, steps=STEPS // 2, name="half")
    runs["resumed"] = fit(world_size, name="resumed", resume=os.path.join(os.environ["GPIPE_TEST_TMP"], "half.ckpt"))
    return runs


def scale_changed_on_rank_zero(rank: int, world_size: int) -> None:
    fit(world_size, chunks=2, callbacks=(HalveScaleOnRankZero(),))


# -- plain PyTorch: GPipe and torch.amp.GradScaler in a loop of one's own, no Lightning ----------------------------


def plain(rank: int, world_size: int, pipelined: bool) -> dict[str, Any]:
    """The same 12 steps in a plain loop (autocast, ``scaler.scale(loss).backward()``, ``scaler.step``, ``update``):
    on a ``GPipe`` over ``world_size`` processes, or (``pipelined=False``) on the Sequential in one process."""
    import torch.distributed as dist

    from lightning_gpipe import GPipe

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model: nn.Module = Net().backbone
    if pipelined:
        dist.init_process_group("gloo")
        model = GPipe(model, chunks=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    scales = []
    for x, y in _loader():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    if pipelined:
        model.close()  # type: ignore[operator]
        dist.destroy_process_group()
    return {"scales": scales, "weights": weights}
