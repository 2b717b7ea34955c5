"""Image classification LightningModules: any Sequential backbone that gives logits, and AmoebaNet-D.

Plain Lightning code: they train the same way with any strategy; under ``strategy="gpipe"`` the
``backbone`` attribute is what the pipeline splits.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from lightning_gpipe.models import amoebanetd

__all__ = ["AmoebaNetClassifier", "ImageClassifier", "load_backbone_weights"]


class ImageClassifier(L.LightningModule):
    """Cross-entropy training of ``backbone`` (an ``nn.Sequential`` whose output is the logits), with top-1
    and top-5 accuracy from torchmetrics.

    Args:
        backbone: the layers, ending in the classifier; index-keyed (``nn.Sequential(*layers)``).
        num_classes: the classifier's outputs, for the metrics.
        optimizer: builds the optimizer from the parameters, e.g. ``partial(torch.optim.SGD, lr=0.1)``.
        lr_scheduler: builds a scheduler from the optimizer; stepped once per epoch.
        warmup_epochs: a linear learning-rate warm-up over this many epochs, stepped every batch, on
            top of ``lr_scheduler`` (both are chainable schedulers, so their factors multiply).
        label_smoothing: of the training loss.
        freeze: the first ``freeze`` layers of the backbone do not train: their parameters get
            ``requires_grad=False`` and their BatchNorm statistics stay as they are (eval mode).
    """

    def __init__(
        self,
        backbone: nn.Sequential,
        num_classes: int,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        warmup_epochs: float = 0.0,
        label_smoothing: float = 0.0,
        freeze: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(backbone, nn.Sequential):
            raise TypeError(f"`backbone` must be an nn.Sequential of layers, got {type(backbone).__name__}.")
        if not 0 <= freeze <= len(backbone):
            raise ValueError(
                f"`freeze` is how many leading backbone layers to freeze, 0 to {len(backbone)}; got {freeze}."
            )
        self.backbone = backbone
        self.num_classes, self.frozen_layers = num_classes, freeze  # not `freeze`: LightningModule.freeze()
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.warmup_epochs, self.label_smoothing = warmup_epochs, label_smoothing
        for layer in list(backbone)[:freeze]:
            layer.requires_grad_(False)
        top5 = min(5, num_classes)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
        self.val_top5 = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes, top_k=top5)
        self.test_top5 = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes, top_k=top5)

    def forward(self, x: Tensor) -> Tensor:
        return self.backbone(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y, label_smoothing=self.label_smoothing)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc, self.val_top5)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc, self.test_top5)

    def _evaluate(
        self, batch: tuple[Tensor, Tensor], stage: str, top1: torchmetrics.Metric, top5: torchmetrics.Metric
    ) -> None:
        x, y = batch
        logits = self(x)
        top1(logits, y)
        top5(logits, y)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y), sync_dist=True)  # one reduce per epoch
        self.log(f"{stage}/acc", top1, prog_bar=True)
        self.log(f"{stage}/acc_top5", top5)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).argmax(dim=1)

    def on_train_epoch_start(self) -> None:
        # Lightning puts the whole model in train mode before each epoch; frozen layers keep their statistics.
        # Under a pipeline the backbone holds only this stage's layers, still under their original indices.
        for name, layer in self.backbone.named_children():
            if int(name) < self.frozen_layers:
                layer.eval()

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer(p for p in self.parameters() if p.requires_grad)
        schedulers = []
        if self.lr_scheduler is not None:
            schedulers.append({"scheduler": self.lr_scheduler(optimizer), "interval": "epoch"})
        if self.warmup_epochs > 0:
            steps_per_epoch = self.trainer.estimated_stepping_batches / max(self.trainer.max_epochs or 1, 1)
            steps = max(int(self.warmup_epochs * steps_per_epoch), 1)
            warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / steps, total_iters=steps)
            schedulers.append({"scheduler": warmup, "interval": "step"})
        return [optimizer], schedulers


class AmoebaNetClassifier(ImageClassifier):
    """:class:`ImageClassifier` with an AmoebaNet-D (L, D) backbone (:func:`lightning_gpipe.models.amoebanetd`).

    Args:
        num_classes, num_layers, num_filters, in_channels, stem, dropout: as in ``amoebanetd``.
        pretrained: a checkpoint of this package (or any ``torch.save``-d dict with a ``state_dict``
            keyed ``backbone.<index>...``) to start from: every backbone tensor but the classifier's is
            loaded, the classifier is new, for a new task (fine-tuning, as in GPipe's transfer learning).
        The others: as in :class:`ImageClassifier`.
    """

    def __init__(
        self,
        num_classes: int = 10,
        num_layers: int = 18,
        num_filters: int = 256,
        in_channels: int = 3,
        stem: Literal["imagenet", "small"] = "imagenet",
        dropout: float = 0.0,
        pretrained: Optional[str] = None,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        warmup_epochs: float = 0.0,
        label_smoothing: float = 0.0,
        freeze: int = 0,
    ) -> None:
        backbone = amoebanetd(num_classes, num_layers, num_filters, in_channels=in_channels, stem=stem, dropout=dropout)
        if pretrained is not None:
            load_backbone_weights(backbone, pretrained, skip_last=1)
        super().__init__(backbone, num_classes, optimizer, lr_scheduler, warmup_epochs, label_smoothing, freeze)
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler", "pretrained"])


def load_backbone_weights(backbone: nn.Sequential, path: str, skip_last: int = 0, prefix: str = "backbone.") -> None:
    """Load the backbone tensors of the checkpoint at ``path`` into ``backbone``, all but its last ``skip_last`` layers.

    Every other layer's tensors must be there with the same shapes; a mismatch is an error that names
    the keys, not a silent partial load.
    """
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # never unpickle code from a file
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds no state_dict; give a checkpoint of this package or a saved state_dict.")
    kept = set(list(backbone._modules)[: len(backbone) - skip_last])  # the layers' names ("0", ... or an OrderedDict's)
    backbone_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    weights = {k: v for k, v in backbone_state.items() if k.split(".")[0] in kept}
    expected = {k for k in backbone.state_dict() if k.split(".")[0] in kept}
    missing, unexpected = expected - weights.keys(), weights.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit the backbone: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}. Build the model with the pretrained run's architecture."
        )
    backbone.load_state_dict(weights, strict=False)
