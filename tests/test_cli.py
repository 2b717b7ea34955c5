"""The ``lightning-gpipe`` CLI: every config parses and runs at a tiny size; the main job learns the digits."""

from __future__ import annotations

import glob
import os
import re
import sys
from unittest import mock

import pytest
import tomllib
import torch
from _scripts import ROOT, run_script

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
