"""``ImageDataModule``: digits (offline, the default), CIFAR-10/100, an ImageFolder tree, or FakeData."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, random_split

__all__ = ["ImageDataModule", "SplitLoaders"]

_NORMALIZE = {  # per-channel mean and std of the training images
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}


class SplitLoaders(L.LightningDataModule):
    """The DataLoaders of a data module whose ``setup`` fills ``splits`` (``"train"``, ``"val"``, ``"test"``);
    ``predict`` runs over the test split.

    A subclass sets ``splits``, ``batch_size`` and ``num_workers`` in ``__init__``.
    """

    splits: dict[str, Dataset]
    batch_size: int
    num_workers: int

    def _loader(self, split: str, train: bool = False) -> DataLoader:
        if not self.splits:
            self.setup("fit")
        # Training drops a last, smaller batch, as usual with BatchNorm (a step on a few samples is a noisy one);
        # the pipeline itself runs any batch size, with min(chunks, batch size) micro-batches.
        return DataLoader(
            self.splits[split],
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        """The test split, in order: what ``trainer.predict`` and ``lightning-gpipe predict`` run over."""
        return self._loader("test")


class ImageDataModule(SplitLoaders):
    """Image classification data: train, validation and test splits, as (image, label) batches.

    Args:
        dataset: ``"digits"``: scikit-learn's 1797 8x8 handwritten digits, 1 channel, no download
            (train/val/test 1257/180/360). ``"cifar10"``, ``"cifar100"``: torchvision's, under
            ``data_dir`` (the test split is CIFAR's own). ``"imagefolder"``: ``data_dir/train`` and
            ``data_dir/val`` with one folder per class (ImageNet's layout); ``val`` serves as the test
            split too. ``"fake"``: torchvision's FakeData, random images.
        data_dir: where the files are (or go, with ``download``).
        download: fetch CIFAR if it is missing; without it nothing is downloaded.
        batch_size: of every split.
        image_size: resize to this side (e.g. 224 or 480 for the ImageNet stem); ``None`` keeps the
            native size (8 for digits, 32 for CIFAR, 224 for ImageFolder and FakeData).
        augment: random crops and flips for training (not for digits: flipping changes a digit).
        val_fraction: the share of CIFAR's or FakeData's training images held out for validation.
        classes: keep only these labels, renumbered ``0..len(classes)-1``: a smaller or new task.
        num_workers: DataLoader workers.
        fake_size, fake_classes: FakeData's number of images and of classes.
        seed: of the splits, so that every process (every pipeline stage) gets the same ones.
    """

    def __init__(
        self,
        dataset: Literal["digits", "cifar10", "cifar100", "imagefolder", "fake"] = "digits",
        data_dir: str = "data",
        download: bool = False,
        batch_size: int = 64,
        image_size: Optional[int] = None,
        augment: bool = True,
        val_fraction: float = 0.1,
        classes: Optional[Sequence[int]] = None,
        num_workers: int = 0,
        fake_size: int = 256,
        fake_classes: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if dataset not in ("digits", "cifar10", "cifar100", "imagefolder", "fake"):
            raise ValueError(f"`dataset` must be digits, cifar10, cifar100, imagefolder or fake; got {dataset!r}.")
        if not 0 < val_fraction < 1:
            raise ValueError(f"`val_fraction` must be between 0 and 1, got {val_fraction}.")
        self.dataset, self.data_dir, self.download = dataset, data_dir, download
        self.batch_size, self.image_size, self.augment = batch_size, image_size, augment
        self.val_fraction, self.num_workers, self.seed = val_fraction, num_workers, seed
        self.fake_size, self.fake_classes = fake_size, fake_classes
        self.classes = list(classes) if classes is not None else None
        self.splits = {}

    @property
    def in_channels(self) -> int:
        return 1 if self.dataset == "digits" else 3

    @property
    def num_classes(self) -> int:
        if self.classes is not None:
            return len(self.classes)
        if self.dataset == "imagefolder":
            train = os.path.join(self.data_dir, "train")
            if not os.path.isdir(train):
                raise ValueError(
                    f"dataset='imagefolder' reads {train}/<class>/<image>; that folder does not exist. "
                    "Set `data_dir` to a folder with train/ and val/ inside."
                )
            return sum(entry.is_dir() for entry in os.scandir(train))
        return {"digits": 10, "cifar10": 10, "cifar100": 100, "fake": self.fake_classes}[self.dataset]

    def prepare_data(self) -> None:
        if self.dataset in ("cifar10", "cifar100") and self.download:
            cifar = self._cifar_class()
            for train in (True, False):
                cifar(self.data_dir, train=train, download=True)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        generator = torch.Generator().manual_seed(self.seed)
        train: Dataset
        val: Dataset
        test: Dataset
        if self.dataset == "digits":
            train, val, test = random_split(_digits(self.image_size), [1257, 180, 360], generator=generator)
        elif self.dataset in ("cifar10", "cifar100"):
            try:
                train, val = self._holdout(
                    lambda t: self._cifar_class()(self.data_dir, train=True, transform=t), generator
                )
                test = self._cifar_class()(self.data_dir, train=False, transform=self._transform(train=False))
            except RuntimeError as error:  # torchvision's "Dataset not found or corrupted" names no path
                raise self._cifar_missing() from error
        elif self.dataset == "imagefolder":
            from torchvision.datasets import ImageFolder

            train = ImageFolder(os.path.join(self.data_dir, "train"), transform=self._transform(train=True))
            val = test = ImageFolder(os.path.join(self.data_dir, "val"), transform=self._transform(train=False))
        else:
            from torchvision.datasets import FakeData

            size = self.image_size or 224

            def fake(transform: Any, count: int = self.fake_size, offset: int = 0) -> Dataset:
                return FakeData(count, (3, size, size), self.fake_classes, transform, random_offset=offset)

            train, val = self._holdout(fake, generator)
            test = fake(self._transform(train=False), max(self.fake_size // 4, 1), offset=self.fake_size)
        self.splits = {name: self._select(split) for name, split in (("train", train), ("val", val), ("test", test))}

    def _holdout(self, make: Any, generator: torch.Generator) -> tuple[Dataset, Dataset]:
        """Train and validation subsets of one training set, each with its own transform."""
        full = make(self._transform(train=True))
        n_val = max(int(len(full) * self.val_fraction), 1)
        order = torch.randperm(len(full), generator=generator).tolist()  # what random_split draws for the indices
        train_idx, val_idx = order[: len(full) - n_val], order[len(full) - n_val :]
        return Subset(full, train_idx), Subset(make(self._transform(train=False)), val_idx)

    def _select(self, dataset: Dataset) -> Dataset:
        if self.classes is None:
            return dataset
        return _Relabeled(dataset, self.classes)

    def _cifar_missing(self) -> ValueError:
        """What torchvision's "Dataset not found or corrupted" means here: which folder, which files, the fixes."""
        folder = os.path.join(self.data_dir, self._cifar_class().base_folder)
        found = (
            "that folder does not exist" if not os.path.isdir(folder) else "its files did not pass torchvision's check"
        )
        return ValueError(
            f"dataset={self.dataset!r} reads torchvision's files in {folder} ({found}: torchvision compares each "
            "file's MD5 with the released archive's, so only the original files pass). Set `data_dir` to the folder "
            "that holds it, or download=True (it needs the network)."
        )

    def _cifar_class(self) -> Any:
        from torchvision.datasets import CIFAR10, CIFAR100

        return CIFAR10 if self.dataset == "cifar10" else CIFAR100

    def _transform(self, train: bool) -> Any:
        from torchvision import transforms as T

        mean, std = _NORMALIZE.get(self.dataset, ((0.5,) * 3, (0.5,) * 3))
        steps: list[Any] = []
        if self.dataset == "imagefolder":
            size = self.image_size or 224
            if train and self.augment:
                steps += [T.RandomResizedCrop(size), T.RandomHorizontalFlip()]
            else:
                steps += [T.Resize(round(size * 8 / 7)), T.CenterCrop(size)]
        else:
            if train and self.augment and self.dataset != "fake":
                steps += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
            if self.image_size is not None and self.dataset != "fake":  # FakeData is made at image_size
                steps.append(T.Resize(self.image_size))
        steps += [T.ToTensor(), T.Normalize(mean, std)]
        return T.Compose(steps)


def _digits(image_size: Optional[int]) -> TensorDataset:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if image_size is not None and image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return TensorDataset((x - 0.5) / 0.5, torch.tensor(data.target))


class _Relabeled(Dataset):
    """The samples of ``dataset`` whose label is in ``classes``, labelled by their position in ``classes``."""

    def __init__(self, dataset: Dataset, classes: list[int]) -> None:
        self.dataset, self.labels = dataset, {c: i for i, c in enumerate(classes)}
        self.indices = [i for i in range(len(dataset)) if int(_label(dataset, i)) in self.labels]  # type: ignore

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        x, y = self.dataset[self.indices[index]]
        return x, self.labels[int(y)]


def _label(dataset: Dataset, index: int) -> int:
    # Reads the label without decoding the image where the dataset allows it (CIFAR's `targets`).
    if isinstance(dataset, Subset):
        return _label(dataset.dataset, dataset.indices[index])
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        return int(targets[index])
    return int(dataset[index][1])
