"""The examples run as scripts, through Lightning's own subprocess launcher."""

from __future__ import annotations

import re

from _scripts import run_script


def test_digits_cnn_trains_over_two_processes_launched_by_lightning():
    output = run_script("examples/digits_cnn.py", "--devices", "2", "--max-epochs", "8")
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", output).group(1))
    assert accuracy > 0.9  # a broken pipeline stays near 0.1


def _checkpoint(path: str) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def test_finetune_example_pretrains_then_finetunes_a_new_head_with_frozen_first_layers(tmp_path):
    import torch

    output = run_script(
        "examples/finetune.py",
        "--devices",
        "2",
        "--pretrain-epochs",
        "2",
        "--finetune-epochs",
        "2",
        "--freeze",
        "2",
        "--out",
        str(tmp_path),
    )
    accuracy = float(re.search(r"fine-tuned test accuracy: ([0-9.]+)", output).group(1))
    assert accuracy > 0.8  # digits 5-9; chance is 0.2
    pretrained, finetuned = (
        _checkpoint(str(tmp_path / "pretrained" / "pretrained.ckpt")),
        _checkpoint(str(tmp_path / "finetuned" / "finetuned.ckpt")),
    )
    assert list(pretrained) == list(finetuned)
    for key in pretrained:
        layer = int(key.split(".")[1])
        if layer < 2:  # frozen: weights and BatchNorm statistics as pretrained
            assert torch.equal(pretrained[key], finetuned[key]), key
    assert not torch.equal(pretrained["backbone.3.current.1.weight"], finetuned["backbone.3.current.1.weight"])
    assert not torch.equal(pretrained["backbone.6.fc.weight"], finetuned["backbone.6.fc.weight"])


def test_finetune_example_starts_from_a_torchvision_weights_file(tmp_path):
    import torch
    import torchvision

    torch.manual_seed(0)
    weights = torchvision.models.resnet18(weights=None).state_dict()  # built here: nothing is downloaded
    torch.save(weights, tmp_path / "resnet18.pt")
    run_script(
        "examples/finetune.py",
        "--devices",
        "2",
        "--torchvision-weights",
        str(tmp_path / "resnet18.pt"),
        "--image-size",
        "32",
        "--freeze",
        "5",
        "--finetune-epochs",
        "1",
        "--limit-train-batches",
        "3",
        "--out",
        str(tmp_path),
    )
    finetuned = _checkpoint(str(tmp_path / "finetuned" / "finetuned.ckpt"))
    # Layer 0 turns gray into RGB; 1 and 2 are conv1 and bn1, frozen: still the file's tensors.
    assert torch.equal(finetuned["backbone.1.weight"], weights["conv1.weight"])
    assert torch.equal(finetuned["backbone.2.running_var"], weights["bn1.running_var"])
    assert finetuned["backbone.15.weight"].shape == (5, 512)  # the new head, for digits 5-9
