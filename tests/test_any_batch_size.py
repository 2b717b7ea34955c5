"""A batch smaller than `chunks` runs with one micro-batch per sample, in every loop, as on one device."""

from __future__ import annotations

import os
from unittest import mock

import _batch_workers as W
import pytest
import torch
from torch import nn

from lightning_gpipe import DeferredBatchNorm, GPipe
from lightning_gpipe.launch import run_ok


@pytest.fixture(scope="module")
def pipeline_runs():
    """``pipeline_runs(K)``: every rank's results of all runs of :mod:`_batch_workers` with K stages (cached)."""
    cache: dict[int, list] = {}

    def get(stages: int) -> list:
        if stages not in cache:
            cache[stages] = run_ok(W.sweep, stages, timeout=300)
        return cache[stages]

    return get


@pytest.fixture(scope="module")
def one_device():
    """``one_device(name)``: the run on one device, with Lightning's default strategy (cached)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            with mock.patch.dict(os.environ):  # Lightning's launcher leaves MASTER_PORT, LOCAL_RANK... behind
                torch.set_num_threads(1)
                cache[name] = W.RUNS[name](1)
        return cache[name]

    return get


def _assert_same(got: dict, expected: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        if key == "weights":
            assert set(got[key]) == set(expected[key])
            for name, value in expected[key].items():
                torch.testing.assert_close(got[key][name], value, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
        elif key == "predictions":
            assert len(got[key]) == len(expected[key])
            for a, b in zip(got[key], expected[key]):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        else:
            assert len(got[key]) == len(expected[key]), key
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(expected[key]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("stages", [2, 3])
def test_short_last_batch_and_batch_size_one_validation_test_and_predict_match_one_device(
    stages, pipeline_runs, one_device
):
    # chunks=4: training batches of 4, 4 and 2 for two epochs; validation (the sanity check too) and predict
    # in batches of 1; test in batches of 2, 2 and 1.
    expected = one_device("short batches everywhere")
    assert len(expected["losses"]) == 6 and len(expected["val_losses"]) == 2 + 3 + 3
    assert len(expected["test_losses"]) == 3 and [p.shape[0] for p in expected["predictions"]] == [1, 1, 1]
    for results in pipeline_runs(stages):
        _assert_same(
            results["short batches everywhere"],
            expected,
            ("losses", "weights", "val_losses", "test_losses", "predictions"),
        )


@pytest.mark.parametrize("stages", [2, 3])
def test_batches_of_three_and_one_with_every_micro_batch_recomputed_match_one_device(stages, pipeline_runs, one_device):
    expected = one_device("batches of three and one")
    assert len(expected["losses"]) == 4
    for results in pipeline_runs(stages):
        _assert_same(results["batches of three and one"], expected, ("losses", "weights"))


@pytest.mark.parametrize("stages", [2, 3])
def test_deferred_batch_norm_moves_its_statistics_once_for_a_short_batch_as_batch_norm_on_one_device(
    stages, pipeline_runs, one_device
):
    # Batches whose samples repeat one sample: per-micro-batch normalization equals the one-device forward, so
    # weights, running_mean, running_var and num_batches_tracked (6: one per batch, the short ones included) agree.
    expected = one_device("deferred batch norm, short batch")
    assert int(expected["weights"]["backbone.2.num_batches_tracked"]) == 6
    for results in pipeline_runs(stages):
        _assert_same(results["deferred batch norm, short batch"], expected, ("losses", "weights"))


def test_deferred_batch_norm_commits_after_the_micro_batches_of_each_call():
    # One process (micro-batching and re-materialization only): batches of 3, then 8 samples with chunks=4.
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.ReLU())
    reference = nn.BatchNorm2d(3)
    reference.load_state_dict(backbone[1].state_dict())
    DeferredBatchNorm.convert_deferred_batch_norm(backbone, chunks=4)
    pipe = GPipe(backbone, chunks=4, checkpoint="always")
    for step, size in enumerate([3, 8, 1]):
        x = torch.randn(size, 2, 3, 3)
        pipe(x).sum().backward()
        with torch.no_grad():
            reference(backbone[0](x))
        assert int(backbone[1].num_batches_tracked) == step + 1
        torch.testing.assert_close(backbone[1].running_mean, reference.running_mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(backbone[1].running_var, reference.running_var, atol=1e-6, rtol=0)
