"""DeferredBatchNorm: mini-batch running statistics, no counting during recompute, and K-process runs."""

from __future__ import annotations

import os
import warnings
from unittest import mock

import _batchnorm_workers as W
import pytest
import torch
from torch import nn

from lightning_gpipe import DeferredBatchNorm, GPipe
from lightning_gpipe.engine.batchnorm import per_micro_batch_norms
from lightning_gpipe.launch import run_ok


def deferred_copy(norm: nn.modules.batchnorm._BatchNorm, chunks: int) -> DeferredBatchNorm:
    holder = nn.Sequential(norm)
    DeferredBatchNorm.convert_deferred_batch_norm(holder, chunks)
    return holder[0]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape, sizes", [((10, 3), [4, 3, 3]), ((9, 3, 4, 5), [5, 4])])
def test_running_statistics_equal_batchnorm_over_the_whole_mini_batch(momentum, shape, sizes):
    torch.manual_seed(0)
    norm_class = nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d
    plain, deferred = norm_class(3, momentum=momentum), deferred_copy(norm_class(3, momentum=momentum), len(sizes))
    for _ in range(4):
        x = torch.randn(*shape) * 3 + 2
        plain(x)
        for part in x.split(sizes):
            deferred(part)
        torch.testing.assert_close(deferred.running_mean, plain.running_mean, atol=1e-6, rtol=0)
        torch.testing.assert_close(deferred.running_var, plain.running_var, atol=1e-6, rtol=1e-6)
        assert deferred.num_batches_tracked == plain.num_batches_tracked


def test_each_micro_batch_is_normalized_with_its_own_statistics_and_eval_uses_the_running_ones():
    torch.manual_seed(0)
    deferred = deferred_copy(nn.BatchNorm2d(3), chunks=2)
    nn.init.normal_(deferred.weight)
    x = torch.randn(8, 3, 2, 2)
    for part in x.split(4):
        expected = nn.functional.batch_norm(part, None, None, deferred.weight, deferred.bias, True, 0.0, 1e-5)
        torch.testing.assert_close(deferred(part), expected)
    plain = nn.BatchNorm2d(3).eval()
    plain.load_state_dict(deferred.state_dict())
    deferred.eval()
    torch.testing.assert_close(deferred(x), plain(x))


def test_recompute_of_checkpointed_micro_batches_is_not_counted():
    # GPipe with one process: micro-batching and re-materialization; every micro-batch is recomputed.
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    reference = nn.BatchNorm1d(6)
    reference.load_state_dict(backbone[1].state_dict())
    DeferredBatchNorm.convert_deferred_batch_norm(backbone, chunks=3)
    pipe = GPipe(backbone, chunks=3, checkpoint="always")
    x = torch.randn(9, 4)
    pipe(x).sum().backward()
    with torch.no_grad():
        reference(backbone[0](x))
    assert int(backbone[1].num_batches_tracked) == 1
    torch.testing.assert_close(backbone[1].running_mean, reference.running_mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(backbone[1].running_var, reference.running_var, atol=1e-6, rtol=0)


def test_conversion_replaces_nested_batch_norms_shares_parameters_and_keeps_batchnorm_keys():
    inner = nn.BatchNorm2d(4)
    untracked = nn.BatchNorm1d(4, track_running_stats=False)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(1, 4, 1), inner), untracked)
    keys = list(model.state_dict())
    DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)
    converted = model[0][1]
    assert isinstance(converted, DeferredBatchNorm) and converted.chunks == 4
    assert converted.weight is inner.weight and converted.running_mean is inner.running_mean
    assert model[1] is untracked  # no running statistics: nothing to defer
    assert list(model.state_dict()) == keys  # checkpoints load into the unconverted model


def test_a_scripted_batch_norm_is_named_by_the_warning_and_refused_by_the_conversion():
    """``torch.jit.script`` turns a BatchNorm into a RecursiveScriptModule, which ``isinstance`` checks miss and
    which cannot be replaced: it was neither converted nor warned about, so its statistics moved per micro-batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated, and still used
        block = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
        untracked = torch.jit.script(nn.BatchNorm1d(3, track_running_stats=False))
    model = nn.Sequential(nn.Linear(3, 3), block, untracked)
    assert per_micro_batch_norms(model) == ["1.1"]
    with pytest.raises(ValueError, match=r"deferred_batch_norm: the BatchNorm layer '1\.1' is compiled by `torch\.jit"):
        DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)


def test_chunks_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="`chunks` must be a positive integer"):
        DeferredBatchNorm(3, chunks=0)


@pytest.fixture(scope="module")
def two_stage_runs():
    return run_ok(W.sweep, 2, timeout=600)


def test_two_stages_with_deferred_batch_norm_match_one_device_batch_norm_statistics_included(two_stage_runs):
    # Batches whose micro-batches are copies of each other: the only difference a pipeline could make
    # is in the running statistics. With DeferredBatchNorm there is none, over 5 steps.
    reference = W.one_device_plain_batch_norm()
    for rank_results in two_stage_runs:
        got = rank_results["tiled deferred"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), atol=1e-6, rtol=0)
        for key, value in reference["weights"].items():  # running_mean, running_var, num_batches_tracked too
            torch.testing.assert_close(got["weights"][key], value, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
        # Plain BatchNorm in the pipeline moves its statistics once per micro-batch: they come out different.
        plain = rank_results["tiled plain"]["weights"]
        assert (plain["backbone.1.running_var"] - reference["weights"]["backbone.1.running_var"]).abs().max() > 1e-3
        steps = reference["weights"]["backbone.1.num_batches_tracked"]
        assert plain["backbone.1.num_batches_tracked"] == W.CHUNKS * steps


def test_training_with_deferred_batch_norm_does_not_depend_on_the_number_of_stages(two_stage_runs):
    with mock.patch.dict(os.environ):  # Lightning's launcher leaves MASTER_PORT, LOCAL_RANK... behind
        one_stage = W.pipelined(devices=1, deferred=True, tiled=False)
    for rank_results in two_stage_runs:
        got = rank_results["shuffled deferred"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(one_stage["losses"]), atol=1e-6, rtol=0)
        for key, value in one_stage["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_plain_batch_norm_survives_recompute_and_moves_once_per_forward_micro_batch(checkpoint):
    # The engine keeps the running statistics aside during a recompute; restoring them must not break
    # the recomputed graph, which holds them (a regression: autograd rejected it as modified in place).
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    reference = nn.BatchNorm1d(6)
    reference.load_state_dict(backbone[1].state_dict())
    pipe = GPipe(backbone, chunks=2, checkpoint=checkpoint)
    x = torch.randn(8, 4)
    pipe(x).sum().backward()
    with torch.no_grad():
        for part in backbone[0](x).split(4):
            reference(part)
    assert backbone[0].weight.grad is not None
    assert int(backbone[1].num_batches_tracked) == 2
    torch.testing.assert_close(backbone[1].running_var, reference.running_var, atol=1e-6, rtol=0)
