"""Transfer learning with a pipeline: pretrain, then fine-tune on a new task with a new head, over K processes.

    python examples/finetune.py --devices 2                        # pretrain on digits 0-4, fine-tune on 5-9
    python examples/finetune.py --devices 2 --freeze 3             # ... keeping the first 3 layers as pretrained
    python examples/finetune.py --devices 2 --torchvision-weights resnet18.pt --freeze 4
                                                                   # start from a torchvision ResNet-18 state_dict

The pretrained weights come from a checkpoint that this package wrote (the whole model, under the
original keys), or from a torchvision ``state_dict`` file given by path, which is mapped into an
``nn.Sequential``. Either way the last layer is a new classifier for the new task, and the first
``--freeze`` layers of the Sequential can stay as pretrained. The GPipe paper's CIFAR results come from
this workflow, at ImageNet scale (``configs/amoebanet_cifar10.yaml``).
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.tasks import AmoebaNetClassifier, ImageClassifier, ImageDataModule

AMOEBANET = dict(num_layers=3, num_filters=16, in_channels=1, stem="small")  # the digits model of the main job


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)


def trainer(args: argparse.Namespace, epochs: int, name: str) -> L.Trainer:
    checkpoint = ModelCheckpoint(  # a directory per phase: Lightning warns of a checkpoint directory already in use
        dirpath=os.path.join(args.out, name), filename=name, save_on_train_epoch_end=True, enable_version_counter=False
    )  # a rerun overwrites its files
    return L.Trainer(
        strategy=GPipeStrategy(chunks=args.chunks, deferred_batch_norm=True),
        accelerator="cpu",
        devices=args.devices,
        max_epochs=epochs,
        logger=False,
        callbacks=[checkpoint],
        limit_train_batches=args.limit_train_batches,
        enable_model_summary=False,
    )


def pretrain(args: argparse.Namespace) -> str:
    """Train on the first task (digits 0-4); returns the checkpoint this package wrote."""
    L.seed_everything(args.seed)
    data = ImageDataModule("digits", batch_size=args.batch_size, classes=range(5))
    model = AmoebaNetClassifier(num_classes=data.num_classes, optimizer=sgd, **AMOEBANET)
    trainer(args, args.pretrain_epochs, "pretrained").fit(model, data)
    return os.path.join(args.out, "pretrained", "pretrained.ckpt")


class GrayToRGB(nn.Module):
    """Repeats a 1-channel image over 3 channels: the digits are gray, ImageNet models expect RGB."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def resnet_sequential(arch: str, weights_path: str, num_classes: int) -> nn.Sequential:
    """A torchvision ResNet with the weights from ``weights_path``, flattened into an index-keyed Sequential
    (every residual block is one layer) whose last layer is a new ``num_classes`` classifier."""
    import torchvision

    resnet = getattr(torchvision.models, arch)(weights=None)
    resnet.load_state_dict(torch.load(weights_path, map_location="cpu"))
    blocks = [resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool]
    for stage in (resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4):
        blocks += list(stage)
    head = nn.Linear(resnet.fc.in_features, num_classes)
    return nn.Sequential(GrayToRGB(), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), head)


def finetune(args: argparse.Namespace, pretrained: str) -> dict[str, float]:
    """Train on the second task (digits 5-9) from the pretrained weights, with a new head."""
    L.seed_everything(args.seed)
    data = ImageDataModule("digits", batch_size=args.batch_size, classes=range(5, 10), image_size=args.image_size)
    if args.torchvision_weights:
        # The Sequential starts with GrayToRGB, so --freeze counts it as a layer.
        backbone = resnet_sequential(args.arch, pretrained, data.num_classes)
        model: ImageClassifier = ImageClassifier(backbone, data.num_classes, optimizer=sgd, freeze=args.freeze)
    else:
        model = AmoebaNetClassifier(
            num_classes=data.num_classes, pretrained=pretrained, optimizer=sgd, freeze=args.freeze, **AMOEBANET
        )
    fit = trainer(args, args.finetune_epochs, "finetuned")
    fit.fit(model, data)
    return fit.test(model, data)[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch")
    parser.add_argument("--pretrain-epochs", type=int, default=4, help="epochs on digits 0-4")
    parser.add_argument("--finetune-epochs", type=int, default=3, help="epochs on digits 5-9")
    parser.add_argument(
        "--freeze", type=int, default=0, help="leading layers of the Sequential that stay as pretrained"
    )
    parser.add_argument("--torchvision-weights", help="a torchvision state_dict file (torch.save) to start from")
    parser.add_argument("--arch", default="resnet18", help="the torchvision architecture of --torchvision-weights")
    parser.add_argument("--image-size", type=int, default=None, help="resize the digits (e.g. 32 for a ResNet)")
    parser.add_argument("--limit-train-batches", type=float, default=1.0, help="Lightning's limit_train_batches")
    parser.add_argument(
        "--out",
        default="runs/finetune",
        help="where the checkpoints go: pretrained/pretrained.ckpt, finetuned/finetuned.ckpt",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed_everything before each phase")
    args = parser.parse_args()
    pretrained = args.torchvision_weights or pretrain(args)
    results = finetune(args, pretrained)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"pretrained weights: {pretrained}")
        print(f"fine-tuned test accuracy: {results['test/acc']:.4f}")


if __name__ == "__main__":
    main()
