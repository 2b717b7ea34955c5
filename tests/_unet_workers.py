"""The U-Net segmenter through the Trainer: pipelined in K processes, and the one-device runs it is compared with."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import lightning as L
import torch

from lightning_gpipe.tasks import ShapesDataModule, UNetSegmenter


@dataclass(frozen=True)
class Run:
    """One training of the small U-Net on the shapes: the model, the data, the pipeline, the Trainer."""

    name: str
    dropout: float = 0.0
    chunks: int = 4
    checkpoint: str = "except_last"
    train_size: int = 512
    epochs: int = 4
    max_steps: int = -1
    weights_after: int = 3  # the step after which the weights are compared with one device

    def model(self) -> UNetSegmenter:
        L.seed_everything(0, verbose=False)
        # SGD: Adam's first steps move a weight by the learning rate whatever its gradient's size, so a gradient
        # near zero that rounds to the other sign (micro-batches sum in another order) moves it the other way.
        optimizer = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
        return UNetSegmenter(depth=3, num_convs=2, base_channels=8, dropout=self.dropout, optimizer=optimizer)

    def data(self) -> ShapesDataModule:
        return ShapesDataModule(train_size=self.train_size, val_size=128, test_size=32, batch_size=32)


#: How far one device and a pipeline can be compared: training this U-Net turns a difference in the last bits
#: into a large one within steps (on one device, nudging every initial weight by 1e-8 moves the first gradients
#: by up to 2e-5 and the weights after 3 steps by 1e-4: max-pooling and leaky ReLUs switch where values nearly
#: tie). A pipeline sums micro-batches' weight gradients in another order, so only the first steps compare.

#: Learns the shapes over 2 stages (dropout off, so one-device Lightning without this package is the reference);
#: 3 micro-batches do not divide the batch of 32.
LEARN = Run("learn", chunks=3, checkpoint="except_last")
#: Dropout acting in every unit: the masks are pipeline-1's, every checkpointed micro-batch recomputes them. The
#: second step's loss checks the masks of the second call; the weights are compared after the first step.
DROPOUT = Run(
    "dropout", dropout=0.1, chunks=4, checkpoint="always", train_size=128, epochs=1, max_steps=2, weights_after=1
)
RUNS = (LEARN, DROPOUT)


def _local(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """This rank's parameters: its stage's (the others are on `meta` under a pipeline) and any outside the backbone."""
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.device.type != "meta"}


class Record(L.Callback):
    """The loss of every step, this rank's gradients of the first and its weights after ``steps`` steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.losses: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.balance: Optional[list[int]] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pipe = getattr(trainer.strategy, "pipe", None)  # the split, while the pipeline lives
        self.balance = list(pipe.balance) if pipe is not None else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step == self.steps:
            self.weights = _local(pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def fit(run: Run, strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """Train, then validate once: losses, first gradients, weights after ``run.weights_after`` steps, validation IoU."""
    record = Record(run.weights_after)
    model = run.model()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=run.epochs,
        max_steps=run.max_steps,
        check_val_every_n_epoch=run.epochs,  # validation once, after the last epoch
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(model, run.data())
    return {
        "balance": record.balance,
        "losses": record.losses,
        "grads": record.grads,
        "weights": record.weights,
        "val_iou": float(trainer.callback_metrics["val/iou"]) if "val/iou" in trainer.callback_metrics else None,
    }


def pipelined(run: Run, devices: int) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    return fit(run, GPipeStrategy(chunks=run.chunks, checkpoint=run.checkpoint), devices)


@contextmanager
def one_thread() -> Iterator[None]:
    """One thread, as each pipeline process has: the thread count changes the rounding of convolutions."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference(run: Run) -> dict[str, Any]:
    """The same training on one device with Lightning's default strategy, without this package's strategy."""
    with one_thread():
        return fit(run)


def pipeline_1(run: Run) -> dict[str, Any]:
    """The same training as a one-stage pipeline in this process: the random streams of every K."""
    with one_thread():
        return pipelined(run, devices=1)


def sweep(rank: int, world_size: int, runs: Optional[tuple[Run, ...]] = None) -> dict[str, Any]:
    return {run.name: pipelined(run, world_size) for run in runs or RUNS}
