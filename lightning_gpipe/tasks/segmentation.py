"""Binary segmentation LightningModules: any Sequential backbone that gives a logit per pixel, and the U-Net.

Plain Lightning code, like the classifiers: they train the same way with any strategy; under
``strategy="gpipe"`` the ``backbone`` attribute is what the pipeline splits, skip connections included.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from torchmetrics.classification import BinaryJaccardIndex

from lightning_gpipe.models import unet

__all__ = ["Segmenter", "UNetSegmenter"]


class Segmenter(L.LightningModule):
    """Per-pixel binary cross-entropy training of ``backbone``, with the IoU of the thresholded masks.

    Batches are ``(image, mask)``: the backbone maps ``image`` (``N, C, H, W``) to one logit per pixel
    (``N, 1, H, W``) and ``mask`` holds 0 or 1 in the same shape. Logged: ``train/loss``, and
    ``{val,test}/loss`` and ``{val,test}/iou`` (torchmetrics' ``BinaryJaccardIndex`` over the whole split,
    the foreground's intersection over union).

    Args:
        backbone: the layers, ending in the per-pixel logits; index-keyed (``nn.Sequential(*layers)``).
        optimizer: builds the optimizer from the parameters, e.g. ``partial(torch.optim.Adam, lr=0.01)``.
        lr_scheduler: builds a scheduler from the optimizer; stepped once per epoch.
        threshold: a pixel is foreground where its probability (the sigmoid of its logit) is above this.
    """

    def __init__(
        self,
        backbone: nn.Sequential,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        threshold: float = 0.5,
    ) -> None:
        super().__init__()
        if not isinstance(backbone, nn.Sequential):
            raise TypeError(f"`backbone` must be an nn.Sequential of layers, got {type(backbone).__name__}.")
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"`threshold` is a probability between 0 and 1, got {threshold}.")
        self.backbone = backbone
        self.optimizer, self.lr_scheduler, self.threshold = optimizer, lr_scheduler, threshold
        self.val_iou = BinaryJaccardIndex(threshold=threshold)
        self.test_iou = BinaryJaccardIndex(threshold=threshold)

    def forward(self, x: Tensor) -> Tensor:
        return self.backbone(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, mask = batch
        loss = F.binary_cross_entropy_with_logits(self(x), mask)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_iou)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_iou)

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, iou: BinaryJaccardIndex) -> None:
        x, mask = batch
        logits = self(x)
        iou(torch.sigmoid(logits), mask.long())  # probabilities: the metric would take logits only outside [0, 1]
        self.log(f"{stage}/loss", F.binary_cross_entropy_with_logits(logits, mask), sync_dist=True)
        self.log(f"{stage}/iou", iou, prog_bar=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return torch.sigmoid(self(x)) > self.threshold

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer(self.parameters())
        if self.lr_scheduler is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.lr_scheduler(optimizer), "interval": "epoch"},
        }


class UNetSegmenter(Segmenter):
    """:class:`Segmenter` with the simplified U-Net (:func:`lightning_gpipe.models.unet`) as its backbone.

    Args:
        depth, num_convs, base_channels, dropout: as in ``unet``.
        in_channels: image channels (``unet``'s ``input_channels``; the CLI takes it from the data).
        The others: as in :class:`Segmenter`.
    """

    def __init__(
        self,
        depth: int = 3,
        num_convs: int = 2,
        base_channels: int = 8,
        in_channels: int = 1,
        dropout: float = 0.1,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        threshold: float = 0.5,
    ) -> None:
        backbone = unet(depth, num_convs, base_channels, input_channels=in_channels, output_channels=1, dropout=dropout)
        super().__init__(backbone, optimizer, lr_scheduler, threshold)
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
