"""The U-Net and its segmentation task: sizes, layers, skips, parameter counts, the shapes data, the module,
the config, and training over 2 stages against one device."""

from __future__ import annotations

import dataclasses
import os
import sys
from unittest import mock

import _unet_workers as U
import lightning as L
import pytest
import torch
from _scripts import ROOT, run_script
from torch import nn

from lightning_gpipe import PopCat, Stash
from lightning_gpipe.cli import run
from lightning_gpipe.engine.skip import SkipRoutes, find_skips
from lightning_gpipe.launch import run_ok
from lightning_gpipe.models import unet
from lightning_gpipe.models.unet import unet_layers
from lightning_gpipe.tasks import Segmenter, ShapesDataModule, UNetSegmenter, draw_shapes

CONFIG = os.path.join(ROOT, "configs", "unet_shapes.yaml")

# -- the model -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "depth, num_convs, size",
    [(3, 2, (17, 23)), (3, 1, (32, 32)), (2, 3, (9, 11)), (4, 1, (33, 40)), (1, 2, (5, 4))],
)
def test_output_has_the_input_height_and_width_odd_sizes_included(depth, num_convs, size):
    torch.manual_seed(0)
    model = unet(depth, num_convs, base_channels=4, input_channels=2, output_channels=3)
    x = torch.randn(2, 2, *size)
    out = model(x)  # training mode: dropout and instance norm as in training
    assert out.shape == (2, 3, *size)
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def _kind(layer: nn.Module) -> str:
    if isinstance(layer, Stash):
        return "stash"
    if isinstance(layer, PopCat):
        return "popcat"
    if isinstance(layer, nn.MaxPool2d):
        return "pool"
    if isinstance(layer, nn.Upsample):
        return "up"
    if isinstance(layer, nn.Conv2d):
        return "conv1x1" if layer.kernel_size == (1, 1) else "conv"
    parts = [type(m) for m in layer.children()]
    return "unit" if parts == [nn.Conv2d, nn.Dropout2d, nn.InstanceNorm2d, nn.LeakyReLU] else type(layer).__name__


@pytest.mark.parametrize("depth, num_convs", [(5, 5), (3, 2), (1, 1)])
def test_every_unit_stash_pool_upsample_and_popcat_is_a_layer_of_its_own(depth, num_convs):
    model = unet(depth, num_convs, base_channels=2)
    assert len(model) == unet_layers(depth, num_convs) == depth * (2 * num_convs + 4) + num_convs + 1
    units = ["unit"] * num_convs
    expected = (units + ["stash", "pool"]) * depth + units + (["up", "popcat"] + units) * depth + ["conv1x1"]
    assert [_kind(layer) for layer in model] == expected
    assert [name for name, _ in model.named_children()] == [str(i) for i in range(len(model))]  # index-keyed


def test_find_skips_pairs_each_encoder_level_with_its_decoder_level_in_its_own_namespace():
    model = unet(4, 2, base_channels=2)
    stashes = [i for i, layer in enumerate(model) if isinstance(layer, Stash)]
    pops = [i for i, layer in enumerate(model) if isinstance(layer, PopCat)]
    routes = find_skips(model)
    # the top level's stash is popped last: the pairs nest, and every stash comes before its pop
    assert [(r.stash_layer, r.pop_layer) for r in routes] == list(zip(stashes, reversed(pops)))
    assert all(r.stash_layer < r.pop_layer for r in routes)
    assert {r.name for r in routes} == {"skip"} and len({r.key for r in routes}) == 4  # one name, 4 namespaces


def _counted(depth: int, num_convs: int, c: int, c_in: int, c_out: int) -> int:
    """The parameters by hand: 3x3 convolutions without bias through each level's widths, and the 1x1 head."""

    def level(first: int, inner: int, last: int) -> int:
        widths = [first] + [inner] * (num_convs - 1) + [last]
        return sum(9 * a * b for a, b in zip(widths, widths[1:]))

    encoder = sum(level(c_in if i == 0 else c * 2 ** (i - 1), c * 2**i, c * 2**i) for i in range(depth))
    bottleneck = level(c * 2 ** (depth - 1), c * 2**depth, c * 2 ** (depth - 1))
    decoder = sum(level(c * 2 ** (i + 1), c * 2**i // 2, c * 2**i // 2) for i in range(depth))
    return encoder + bottleneck + decoder + c // 2 * c_out


def test_parameter_count_matches_a_count_by_hand():
    model = unet(3, 2, base_channels=8, input_channels=1, output_channels=1)
    assert sum(p.numel() for p in model.parameters()) == _counted(3, 2, 8, 1, 1) == 69_916
    model = unet(2, 3, base_channels=6, input_channels=3, output_channels=2)
    assert sum(p.numel() for p in model.parameters()) == _counted(2, 3, 6, 3, 2)


@pytest.mark.parametrize(
    "num_convs, channels, millions",
    [(6, 72, 362.2), (11, 128, 2210), (24, 128, 4990), (24, 160, 7800), (48, 160, 15820)],
)
def test_parameter_counts_match_torchgpipes_published_unet_sizes(num_convs, channels, millions):
    # torchgpipe's U-Net memory benchmark (depth 5, 3 input channels, 1 output): (B, C) -> 362.2M, 2.21B,
    # 4.99B, 7.80B, 15.82B. Tolerance: half the last digit given.
    with torch.device("meta"):  # no memory: 15.8B parameters would take 63 GB in float32
        model = unet(5, num_convs, channels)
    count = sum(p.numel() for p in model.parameters())
    tolerance = 0.05 if millions < 1000 else 5
    assert abs(count / 1e6 - millions) < tolerance, count
    assert count == _counted(5, num_convs, channels, 3, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(depth=0), "`depth`"), (dict(num_convs=0), "`num_convs`"), (dict(base_channels=2.5), "`base_channels`")],
)
def test_bad_sizes_raise_errors_that_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        unet(**kwargs)
    with pytest.raises(ValueError, match="`dropout`"):
        unet(dropout=1.0)


# -- the data ------------------------------------------------------------------------------------------


def test_the_same_seed_draws_the_same_images_and_masks_and_another_seed_others():
    a, b, c = draw_shapes(16, seed=3), draw_shapes(16, seed=3), draw_shapes(16, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_images_and_binary_masks_have_the_requested_shape_and_every_image_has_a_shape():
    images, masks = draw_shapes(64, image_size=24, max_shapes=2, seed=1)
    assert images.shape == masks.shape == (64, 1, 24, 24)
    assert images.dtype == masks.dtype == torch.float32
    assert set(masks.unique().tolist()) == {0.0, 1.0}
    assert (masks.flatten(1).sum(1) > 0).all()  # at least one shape, inside the image
    assert 0.05 < masks.mean() < 0.5


def test_no_threshold_of_the_intensity_finds_the_shapes():
    """Shapes brighter and darker than a sloped background: a segmenter has to see edges (the U-Net: 0.7+)."""
    images, masks = draw_shapes(256, seed=1)
    target = masks.bool()
    best = 0.0
    for sign in (1.0, -1.0):
        for threshold in torch.linspace(-2, 2, 81):
            predicted = sign * images > threshold
            best = max(best, float((predicted & target).sum() / (predicted | target).sum()))
    assert best < 0.3, best  # measured 0.227; predicting all foreground: 0.128


def test_data_module_draws_three_different_splits_of_the_requested_sizes():
    data = ShapesDataModule(image_size=16, train_size=40, val_size=8, test_size=12, batch_size=8, seed=2)
    data.setup("fit")
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [40, 8, 12]
    firsts = [data.splits[s].tensors[0][0] for s in ("train", "val", "test")]
    assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])
    x, mask = next(iter(data.train_dataloader()))
    assert x.shape == mask.shape == (8, 1, 16, 16) and data.in_channels == 1
    again = ShapesDataModule(image_size=16, train_size=40, val_size=8, test_size=12, seed=2)
    again.setup("fit")
    assert torch.equal(again.splits["val"].tensors[1], data.splits["val"].tensors[1])
    with pytest.raises(ValueError, match="`val_size`"):
        ShapesDataModule(val_size=0)


# -- the module ----------------------------------------------------------------------------------------


def test_segmenter_logs_the_iou_of_the_thresholded_predictions_over_the_whole_split():
    L.seed_everything(0, verbose=False)
    model = UNetSegmenter(depth=2, num_convs=1, base_channels=4)
    data = ShapesDataModule(image_size=16, train_size=32, val_size=40, test_size=8, batch_size=16)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(model, data)
    (metrics,) = trainer.validate(model, data, verbose=False)
    x, mask = data.splits["val"].tensors
    model.eval()
    with torch.no_grad():
        logits = model(x)
    predicted, target = torch.sigmoid(logits) > 0.5, mask.bool()
    expected = (predicted & target).sum() / (predicted | target).sum()  # over all 40 images, not per batch
    assert metrics["val/iou"] == pytest.approx(float(expected), abs=1e-6)
    assert metrics["val/loss"] == pytest.approx(
        float(nn.functional.binary_cross_entropy_with_logits(logits, mask)), abs=1e-5
    )
    assert torch.equal(model.predict_step((x, mask), 0), predicted)


def test_segmenter_refuses_a_backbone_that_is_not_a_sequential_and_a_threshold_outside_0_1():
    with pytest.raises(TypeError, match="`backbone` must be an nn.Sequential"):
        Segmenter(nn.Conv2d(1, 1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`threshold`"):
        Segmenter(nn.Sequential(nn.Conv2d(1, 1, 1)), threshold=1.0)


# -- the config ----------------------------------------------------------------------------------------

TINY = [  # a batch of each split, 16x16 images, the smallest U-Net of the config's depth
    "--trainer.fast_dev_run=true",
    "--trainer.enable_progress_bar=false",
    "--model.base_channels=4",
    "--model.num_convs=1",
    "--data.image_size=16",
    "--data.train_size=16",
    "--data.val_size=8",
    "--data.test_size=8",
    "--data.batch_size=8",
]


def test_unet_config_names_its_classes_and_gives_the_model_the_datas_channels(tmp_path):
    with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", ["lightning-gpipe"]):
        cli = run(["fit", "--config", CONFIG, *TINY, "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}"])
    assert type(cli.model) is UNetSegmenter and type(cli.datamodule) is ShapesDataModule
    assert cli.model.hparams.in_channels == cli.datamodule.in_channels == 1  # linked; no num_classes to link
    assert cli.model.hparams.depth == 3 and cli.model.hparams.base_channels == 4  # the config, then the override
    assert cli.trainer.state.fn == "test" and 0.0 <= float(cli.trainer.callback_metrics["test/iou"]) <= 1.0


def test_unet_config_runs_as_written_over_two_processes(tmp_path):
    """The console command as a user runs it (``python -m``), with the config's 2 stages, at a tiny size."""
    output = run_script(
        "-m", "lightning_gpipe.cli", "fit", "--config", CONFIG, *TINY, f"--trainer.default_root_dir={tmp_path}"
    )
    assert "GPipe split of `backbone` into 2 stages" in output
    assert "PipelineMonitor: 2 stages x 4 micro-batches" in output
    assert "test results: test/iou=" in output


# -- training over 2 stages ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_stages() -> list[dict]:
    """Every rank's results of :data:`_unet_workers.RUNS` over 2 stages: one spawn."""
    return run_ok(U.sweep, 2, timeout=300)


def _assert_same_start(ranks: list[dict], name: str, reference: dict, steps: int) -> None:
    """The first ``steps`` losses on every rank; the first gradients and the compared weights, each on one rank."""
    grads: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for results in ranks:
        got = results[name]
        assert len(got["losses"]) == len(reference["losses"])
        torch.testing.assert_close(
            torch.tensor(got["losses"][:steps]), torch.tensor(reference["losses"][:steps]), atol=1e-6, rtol=0
        )
        assert not set(got["grads"]) & set(grads)  # each stage holds its own layers
        grads.update(got["grads"])
        weights.update(got["weights"])
    assert set(grads) == set(reference["grads"]) and set(weights) == set(reference["weights"])
    for key, value in reference["grads"].items():
        torch.testing.assert_close(grads[key], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: grad {key}: {m}")
    for key, value in reference["weights"].items():
        torch.testing.assert_close(weights[key], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: weight {key}: {m}")


def test_unet_trains_over_two_stages_as_on_one_device_to_an_iou_of_0_6(two_stages):
    """Every skip crosses from stage 0 to stage 1. Compared with one-device Lightning: the first 3 steps' losses
    and weights and the first gradients to 1e-6 (later steps part by rounding, see ``_unet_workers``), and the
    validation IoU after 64 steps (measured 0.716 over 2 stages, 0.736 on one device)."""
    reference = U.reference(U.LEARN)
    balance = two_stages[0]["learn"]["balance"]
    assert len(balance) == 2 and all(r["learn"]["balance"] == balance for r in two_stages)
    model = unet(3, 2, base_channels=8, input_channels=1)
    assert SkipRoutes(find_skips(model), balance).pairs() == {(0, 1)}
    assert len(SkipRoutes(find_skips(model), balance).leaving(0)[1]) == 3  # all three levels' skips cross
    _assert_same_start(two_stages, "learn", reference, steps=3)
    ious = [results["learn"]["val_iou"] for results in two_stages]
    assert ious[0] == ious[1]  # every rank's metric saw the real output
    assert ious[0] >= 0.6 and reference["val_iou"] >= 0.6, (ious, reference["val_iou"])
    assert abs(ious[0] - reference["val_iou"]) < 0.05


def test_unet_with_dropout_over_two_stages_draws_the_masks_of_pipeline_1(two_stages):
    """Dropout in every unit, every micro-batch recomputed: both steps' losses, the first gradients and the
    weights after step 1 equal a one-stage pipeline's (which draws the same masks) to 1e-6."""
    one = U.pipeline_1(U.DROPOUT)
    _assert_same_start(two_stages, "dropout", one, steps=2)
    without = U.pipeline_1(dataclasses.replace(U.DROPOUT, dropout=0.0))
    assert one["losses"][0] != without["losses"][0]  # and dropout did act
