"""The ``lightning-gpipe`` CLI: every config parses and runs at a tiny size; the main job learns the digits."""

from __future__ import annotations

import glob
import os
import re
import sys
from unittest import mock

import lightning as L
import pytest
import tomllib
import torch
from _scripts import ROOT, run_script
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpipe.cli import run

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "amoebanet_*.yaml")))  # the U-Net's: tests/test_unet.py

TINY = [  # CPU, one process, FakeData at 64x64, AmoebaNet-D (3, 8), one batch of each split
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.precision=32-true",
    "--trainer.fast_dev_run=true",
    "--trainer.strategy.init_args.chunks=2",
    "--model.num_layers=3",
    "--model.num_filters=8",
    "--data.dataset=fake",
    "--data.image_size=64",
    "--data.fake_size=64",
    "--data.batch_size=16",
    "--data.num_workers=0",
    "--data.download=false",
]


def test_there_are_configs_for_digits_cifar10_and_imagenet_at_224_and_480():
    names = {os.path.basename(c) for c in CONFIGS}
    assert {
        "amoebanet_digits.yaml",
        "amoebanet_cifar10.yaml",
        "amoebanet_imagenet224.yaml",
        "amoebanet_imagenet480.yaml",
    } <= names


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_config_parses_and_fits_then_tests_with_fast_dev_run_at_a_tiny_size(config, tmp_path):
    # Lightning's launcher sets MASTER_PORT, LOCAL_RANK...: keep them here; and the CLI reads args, not pytest's argv.
    with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", ["lightning-gpipe"]):
        cli = run(["fit", "--config", config, *TINY, f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.state.finished and cli.trainer.state.fn == "test"  # fit, then the test after it
    assert cli.trainer.callback_metrics["test/acc"].numel() == 1
    assert cli.model.num_classes == cli.datamodule.num_classes  # linked from the data
    # `predict` failed on every shipped config: the data module had no predict_dataloader (it predicts the test split)
    with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", ["lightning-gpipe"]):
        cli = run(["predict", "--config", config, *TINY, f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.state.finished and cli.trainer.state.fn == "predict"


class OwnData(L.LightningDataModule):
    """A DataModule of a user's, of 8x8 RGB images, whose argument shares its name with the default data's (64
    there)."""

    def __init__(self, batch_size: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.batch_size, self.num_classes = batch_size, num_classes

    def train_dataloader(self) -> DataLoader:
        images, labels = torch.randn(32, 3, 8, 8), torch.randint(0, self.num_classes, (32,))
        return DataLoader(TensorDataset(images, labels), batch_size=self.batch_size)


class OwnModel(L.LightningModule):
    """A model of a user's, whose arguments share names with the default model's (10 classes and a
    `label_smoothing` of 0.0 there)."""

    def __init__(self, num_classes: int = 3, label_smoothing: float = 0.25) -> None:
        super().__init__()
        self.num_classes, self.label_smoothing = num_classes, label_smoothing
        self.backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 8), torch.nn.Linear(8, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.backbone(x), y, label_smoothing=self.label_smoothing)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("own", [["data"], ["model", "data"]], ids=["own data", "own model and data"])
def test_a_config_naming_its_own_classes_keeps_their_defaults_not_the_default_classes(own, tmp_path):
    # jsonargparse hands the arguments of the default class on to the class a config names where it takes them too:
    # a DataModule whose batch_size defaults to 8 trained on batches of 64, ImageDataModule's
    config = tmp_path / "own.yaml"
    lines = [f"{key}:\n  class_path: test_cli.Own{key.capitalize()}" for key in own]
    config.write_text("\n".join(["trainer: {accelerator: cpu, devices: 1}", *lines]) + "\n")
    with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", ["lightning-gpipe"]):
        cli = run(
            [
                "fit",
                "--config",
                str(config),
                "--trainer.fast_dev_run=true",
                f"--trainer.default_root_dir={tmp_path}",
                "--test_after_fit=false",
                *([] if "model" in own else ["--model.num_layers=3", "--model.num_filters=8", "--model.stem=small"]),
            ]
        )
    assert cli.datamodule.batch_size == 8
    if "model" in own:
        assert cli.model.label_smoothing == 0.25
    else:  # the default model, with its own defaults, and its classes from the data
        assert cli.model.label_smoothing == 0.0 and cli.model.num_classes == cli.datamodule.num_classes == 10


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["lightning-gpipe"] == "lightning_gpipe.cli:main"


def _readme_main_command() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"<!-- main-command -->\s*```bash\n(.*?)```", f.read(), re.S).group(1)
    return block.split("lightning-gpipe", 1)[1].split()


def _fit(tmp_path, name: str, *overrides: str) -> tuple[str, dict[str, torch.Tensor]]:
    """The README's main command (as ``python -m``: the console script is this module's ``main``)."""
    root = os.path.join(tmp_path, name)
    args = [
        *_readme_main_command(),
        "--trainer.enable_checkpointing=true",
        f"--trainer.default_root_dir={root}",
        *overrides,
    ]
    # One thread per process in both runs: on the CPU, the number of threads changes the rounding of
    # reductions in convolutions, and Lightning would give 1 process 2 threads but 2 processes 1 each.
    output = run_script("-m", "lightning_gpipe.cli", *args, timeout=600, OMP_NUM_THREADS="1")
    (checkpoint,) = glob.glob(os.path.join(root, "checkpoints", "*.ckpt"))
    # weights_only=True: a Lightning checkpoint of the classifier (hyper_parameters included) needs no unpickling,
    # which is how `pretrained=` reads it
    return output, torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def test_main_job_learns_the_digits_over_two_processes_as_on_one_device(tmp_path):
    pipelined, weights = _fit(tmp_path, "two-stages")
    one_device, reference = _fit(tmp_path, "one-device", "--trainer.devices=1")
    accuracy = [float(re.search(r"test/acc=([0-9.]+)", out).group(1)) for out in (pipelined, one_device)]
    assert accuracy[0] >= 0.95, pipelined[-3000:]
    assert accuracy[0] == accuracy[1]
    for key, value in reference.items():  # the same seed, the same training: K does not change what is learned
        torch.testing.assert_close(weights[key], value, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
    assert "GPipe plan for 2 stages (chunks=2, checkpoint='auto', balance='auto')" in pipelined  # the planner's table
    assert "PipelineMonitor: 2 stages x 2 micro-batches" in pipelined  # per-stage times, at the end of fit
    assert re.search(r"Epoch 4: 100%", pipelined)  # the progress bar
