"""The image-classification task: every data source (files written here, nothing downloaded) and the module."""

from __future__ import annotations

import os
import pickle
import re

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.tasks import AmoebaNetClassifier, ImageClassifier, ImageDataModule, load_backbone_weights


def first_batch(data: ImageDataModule, split: str = "train"):
    data.setup("fit")
    return next(iter(getattr(data, f"{split}_dataloader")()))


def test_digits_are_the_offline_default_with_fixed_splits():
    data = ImageDataModule(batch_size=16)
    assert (data.dataset, data.in_channels, data.num_classes) == ("digits", 1, 10)
    data.setup("fit")
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [1257, 180, 360]
    x, y = first_batch(data)
    assert x.shape == (16, 1, 8, 8) and y.dtype == torch.long


def test_classes_keep_a_subset_renumbered_from_zero():
    data = ImageDataModule(classes=[5, 6, 7, 8, 9], image_size=16, batch_size=400)
    assert data.num_classes == 5
    x, y = first_batch(data, "test")
    assert x.shape[1:] == (1, 16, 16)
    assert set(y.tolist()) == {0, 1, 2, 3, 4} and len(data.splits["test"]) < 360


def _write_cifar(root: str, hundred: bool, per_file: int = 6) -> None:
    """A tiny CIFAR in torchvision's on-disk layout: pickled dicts of uint8 rows of 3x32x32 pixels."""
    rng = np.random.default_rng(0)
    folder = os.path.join(root, "cifar-100-python" if hundred else "cifar-10-batches-py")
    os.makedirs(folder)
    label_key, classes = ("fine_labels", 100) if hundred else ("labels", 10)
    files = ["train", "test"] if hundred else [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in files:
        batch = {
            "data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
            label_key: rng.integers(0, classes, per_file).tolist(),
        }
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(batch, f)
    names = [f"c{i}" for i in range(classes)]
    meta = {"fine_label_names": names} if hundred else {"label_names": names}
    with open(os.path.join(folder, "meta" if hundred else "batches.meta"), "wb") as f:
        pickle.dump(meta, f)


@pytest.mark.parametrize("name, hundred", [("cifar10", False), ("cifar100", True)])
def test_cifar_reads_torchvisions_files_without_downloading(tmp_path, monkeypatch, name, hundred):
    _write_cifar(str(tmp_path), hundred)
    # torchvision checks the real files' md5 sums; these tiny stand-ins only need to exist.
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda path, md5=None: os.path.isfile(path))
    data = ImageDataModule(name, data_dir=str(tmp_path), download=False, batch_size=4, image_size=64)
    data.prepare_data()  # download=False: nothing fetched
    assert (data.in_channels, data.num_classes) == (3, 100 if hundred else 10)
    data.setup("fit")
    total = 6 if hundred else 30  # CIFAR-100 has one training file, CIFAR-10 five
    assert len(data.splits["train"]) + len(data.splits["val"]) == total and len(data.splits["test"]) == 6
    x, _ = first_batch(data)
    assert x.shape == (4, 3, 64, 64)


@pytest.mark.parametrize("written", [False, True], ids=["no folder", "files that fail torchvision's check"])
def test_cifar_files_torchvision_refuses_are_named_with_their_folder_and_the_fixes(tmp_path, written):
    # torchvision's "Dataset not found or corrupted. You can use download=True" named no path, and read the same for a
    # missing folder and for hand-made files (its MD5 check passes the released files only)
    if written:
        _write_cifar(str(tmp_path), hundred=False)
    data = ImageDataModule("cifar10", data_dir=str(tmp_path), download=False)
    folder = os.path.join(str(tmp_path), "cifar-10-batches-py")
    found = "its files did not pass torchvision's check" if written else "that folder does not exist"
    with pytest.raises(ValueError, match=re.escape(f"reads torchvision's files in {folder} ({found}")) as refused:
        data.setup("fit")
    assert "download=True" in str(refused.value) and "MD5" in str(refused.value)


def test_image_folder_reads_imagenet_layout_with_one_folder_per_class(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("n01", "n02", "n03"):
            os.makedirs(tmp_path / split / cls)
            for i in range(2):
                pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.{'png' if i else 'jpg'}")
    data = ImageDataModule("imagefolder", data_dir=str(tmp_path), image_size=32, batch_size=6)
    assert data.num_classes == 3
    x, y = first_batch(data)
    assert x.shape == (6, 3, 32, 32) and set(y.tolist()) == {0, 1, 2}
    assert first_batch(data, "test")[0].shape == (6, 3, 32, 32)


def test_fake_data_has_the_requested_size_and_classes():
    data = ImageDataModule("fake", image_size=32, fake_size=40, fake_classes=4, batch_size=8)
    assert data.num_classes == 4
    data.setup("fit")
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [36, 4, 10]
    assert first_batch(data)[0].shape == (8, 3, 32, 32)


def test_bad_data_arguments_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="`dataset` must be digits, cifar10"):
        ImageDataModule("mnist")
    with pytest.raises(ValueError, match="`data_dir` to a folder with train/ and val/"):
        _ = ImageDataModule("imagefolder", data_dir=str(tmp_path)).num_classes


def _tiny(**kwargs) -> AmoebaNetClassifier:
    return AmoebaNetClassifier(num_classes=10, num_layers=3, num_filters=8, in_channels=1, stem="small", **kwargs)


def test_frozen_layers_keep_their_weights_and_batch_norm_statistics():
    L.seed_everything(0, verbose=False)
    model = _tiny(freeze=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    after = model.state_dict()
    frozen = [k for k in before if k.split(".")[1] in ("0", "1")]
    trained = [k for k in before if k.startswith("backbone.2.") and "weight" in k]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)  # running statistics too
    assert any(not torch.equal(before[k], after[k]) for k in trained)


def test_pretrained_checkpoint_loads_everything_but_the_classifier(tmp_path):
    torch.manual_seed(0)
    source = _tiny()
    path = str(tmp_path / "pretrained.ckpt")
    torch.save({"state_dict": source.state_dict()}, path)
    torch.manual_seed(1)
    target = AmoebaNetClassifier(
        num_classes=5, num_layers=3, num_filters=8, in_channels=1, stem="small", pretrained=path
    )
    for key, value in source.backbone.state_dict().items():
        if key.startswith("6."):  # the classifier: new, and of another shape
            assert target.backbone.state_dict()[key].shape != value.shape
        else:
            assert torch.equal(target.backbone.state_dict()[key], value), key


def test_a_checkpoint_of_another_architecture_is_an_error_naming_the_keys(tmp_path):
    path = str(tmp_path / "other.ckpt")
    torch.save({"state_dict": _tiny().state_dict()}, path)
    wider = AmoebaNetClassifier(num_classes=10, num_layers=6, num_filters=8, in_channels=1, stem="small").backbone
    with pytest.raises(ValueError, match="does not fit the backbone: missing"):
        load_backbone_weights(wider, path, skip_last=1)


def test_classifier_needs_a_sequential_and_a_valid_freeze():
    with pytest.raises(TypeError, match="`backbone` must be an nn.Sequential"):
        ImageClassifier(torch.nn.Linear(2, 2), num_classes=2)
    with pytest.raises(ValueError, match="`freeze` is how many leading backbone layers"):
        ImageClassifier(torch.nn.Sequential(torch.nn.Linear(2, 2)), num_classes=2, freeze=3)
