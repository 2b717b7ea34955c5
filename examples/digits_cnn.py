"""A small CNN on the offline 8x8 digits, pipelined over 2 CPU processes with ``strategy="gpipe"``.

    python examples/digits_cnn.py --devices 2 --max-epochs 8

The LightningModule is ordinary one-device code; only the Trainer's ``strategy`` changes.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

import lightning_gpipe  # noqa: F401  (registers strategy="gpipe")
from lightning_gpipe import GPipeStrategy


class DigitsCNN(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * 2 * 2, 128),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(128, 10),
        )
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self.backbone(x), y)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self.backbone(x), y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def digits(batch_size: int):
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    train, val, test = random_split(TensorDataset(x, y), [1257, 180, 360], generator=torch.Generator().manual_seed(0))
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True),
        DataLoader(val, batch_size=256),
        DataLoader(test, batch_size=256),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--max-epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    L.seed_everything(0)
    train, val, test = digits(args.batch_size)
    model = DigitsCNN()
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=args.chunks),
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, train, val)
    result = trainer.test(model, test)
    if trainer.is_global_zero:
        print(f"test accuracy: {result[0]['test/acc']:.4f}")


if __name__ == "__main__":
    main()
