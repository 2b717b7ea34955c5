"""Ordinary Lightning features under the pipeline (K=2) against one device: the rows of docs/compatibility.md."""

from __future__ import annotations

import math
from typing import Any

import _compat
import pytest
import torch

from lightning_gpipe.launch import run_ok

NAMES = list(_compat.SCENARIOS)


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(one device, [rank 0, rank 1] pipelined), for every scenario; two spawns in all."""
    (reference,) = run_ok(_compat.one_device, 1, NAMES, timeout=600)
    pipelined = run_ok(_compat.pipelined, 2, NAMES, timeout=600)
    return reference, pipelined


def _same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert list(got) == list(want)  # the whole model, under the one-device keys, in one-device order
    worst = 0.0
    for key in want:
        worst = max(worst, (got[key] - want[key]).abs().max().item())
    return worst


def _check(name: str, runs: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reference, pipelined = runs
    want = reference[name]
    ranks = [rank[name] for rank in pipelined]
    for got in ranks:  # every rank ends with the one-device model, at the same step
        assert _same_weights(got["weights"], want["weights"]) <= 1e-6, name
        assert (got["steps"], got["epochs"]) == (want["steps"], want["epochs"])
        assert set(got["metrics"]) == set(want["metrics"])
        for key, value in want["metrics"].items():
            torch.testing.assert_close(got["metrics"][key], value, atol=1e-6, rtol=0, msg=f"{name}: {key}")
    return want, ranks


def _same_evaluations(got: dict[str, Any], want: dict[str, Any]) -> None:
    """The records of ``validate``, ``test`` (logged values) and ``predict`` (two batches) equal one device's."""
    for call in ("validate", "test"):
        assert got[call][0].keys() == want[call][0].keys()
        for key, value in want[call][0].items():
            assert got[call][0][key] == pytest.approx(value, abs=1e-6), (call, key)
    assert len(got["predict"]) == len(want["predict"]) == 2
    for batch, expected in zip(got["predict"], want["predict"]):
        torch.testing.assert_close(batch, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "name",
    [
        "accumulate_grad_batches",
        "contrastive_all_gather",
        "clip_by_norm",
        "clip_by_value",
        "lr_scheduler",
        "reduce_lr_on_plateau",
        "manual_optimization",
        "two_optimizers",
        "compiled_layers",
        "scripted_layers",
        "layer_with_its_own_generator",
        "embedding_first",
        "sparse_embedding_first",
        "backbone_called_twice",
        "tuples_across_stages",
        "structures_across_stages",
        "complex_activations",
        "dataclass_batches",
        "unseeded_initial_weights",
        "unseeded_data_split",
        "loop_limits",
        "overfit_batches",
        "fast_dev_run",
        "accumulation_scheduler",
        "detect_anomaly",
        "backbone_in_configure_model",
        "toggled_optimizers",
        "clipping_hook",
        "metric_collection",
        "rank_zero_random_draws",
        "workers_seeded_by_lightning",
        "rank_zero_weight_changes",
        "double_precision",
        "averaged_model_in_init",
        "frozen_teacher",
        "backbone_hooks",
        "weight_norm_layers",
    ],
)
def test_feature_trains_as_on_one_device(name, runs):
    _check(name, runs)


@pytest.mark.parametrize(
    "name",
    [
        "simple_profiler",
        "advanced_profiler",
        "combined_loader",
        "batch_transfer_hooks",
        "deterministic_algorithms",
        "without_inference_mode",
        "own_sampler",
        "barebones",
        "one_cycle_schedule",
        "iterable_dataset",
        "sparse_batches",
        "step_without_backbone",
        "backbone_under_no_grad",
        "frozen_backbone",
        "frozen_last_layer",
        "validation_every_two_steps",
        "built_under_init_module",
        "module_in_two_places",
        "lstm_in_backbone",
        "lstm_single_samples",
        "groups_by_position",
        "groups_by_depth",
        "epoch_ended_by_the_hook",
    ],
)
def test_loop_setting_or_data_source_trains_as_on_one_device(name, runs):
    _check(name, runs)


def test_a_second_trainer_fits_the_same_module_again_after_unfreezing_as_on_one_device(runs):
    want, ranks = _check("second_trainer_after_unfreezing", runs)
    assert want["record"]["second_fit"] == (4, 1, True)  # 4 more steps, in which the unfrozen layer trained
    for got in ranks:
        assert got["record"] == want["record"]


def test_overridden_optimizer_hooks_step_and_schedule_as_on_one_device(runs):
    want, ranks = _check("optimizer_hooks_overridden", runs)
    assert want["record"]["scheduler_calls"] == want["steps"] == 8
    for got in ranks:
        assert got["record"] == want["record"]


def test_async_checkpoint_io_writes_every_checkpoint_whole_as_on_one_device(runs):
    # the full file was written to a temporary name and renamed in the caller's thread, while AsyncCheckpointIO
    # writes later in its own: the rename found no file and the run ended in a FileNotFoundError at the first save
    want, (first, second) = _check("async_checkpoint_io", runs)
    assert list(want["record"]["files"]) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt"]
    assert "files" not in second["record"]  # rank 1 wrote nothing: the directory is rank 0's
    assert list(first["record"]["files"]) == list(want["record"]["files"])  # no temporary file left beside them
    for name, (step, weights) in want["record"]["files"].items():
        got_step, got = first["record"]["files"][name]
        assert got_step == step
        assert _same_weights(got, weights) <= 1e-6, name


@pytest.mark.parametrize(
    "name",
    [
        "saliency_from_its_own_call",
        "saliency_in_manual_optimization",
        "backward_inputs_stem",
        "backward_inputs_head",
    ],
)
def test_a_backward_that_asks_for_some_gradients_only_gives_them_as_on_one_device(name, runs):
    # the drain added every stage parameter's gradient to .grad whatever was asked: a saliency map's went into the
    # next step (23.1 off one device under manual optimization, 7.3 with accumulation)
    _check(name, runs)


def test_layers_named_in_an_ordered_dict_keep_their_names_on_every_stage(runs):
    want, ranks = _check("named_layers", runs)  # param groups chosen by name and by attribute train as on one device
    names = want["record"]["names"]
    assert names[0] == "backbone.embed.weight" and names[-1] == "backbone.head.bias"
    assert ranks[0]["record"]["names"] + ranks[1]["record"]["names"] == names  # each stage its own, by the same names
    assert ranks[0]["record"]["saved"] == want["record"]["saved"]  # the checkpoint under the one-device keys


def test_max_time_stops_every_stage_after_the_same_step_with_the_same_model(runs):
    reference, pipelined = runs
    first, second = (rank["time_limit"] for rank in pipelined)
    assert reference["time_limit"]["steps"] > 8  # stopped by the clock, not by the default 2 epochs (8 steps)
    assert 8 < first["steps"] == second["steps"] and first["epochs"] == second["epochs"]
    assert _same_weights(first["weights"], second["weights"]) == 0.0  # the whole model, equal on every rank


def test_device_stats_monitor_logs_the_one_device_keys_on_rank_zero(runs):
    want, ranks = _check("device_stats", runs)
    keys = lambda rows: sorted({k for row in rows for k in row})  # noqa: E731
    assert any(k.startswith("DeviceStatsMonitor") for k in keys(want["logged"]))
    assert keys(ranks[0]["logged"]) == keys(want["logged"]) and ranks[1]["logged"] is None


def test_loaders_rebuilt_every_epoch_by_a_hook_with_a_collective_train_as_on_one_device_and_every_rank_builds_alike(
    runs,
):
    # rank 0 profiles the backbone on the first batch during setup: once it called the hook alone (4 against 3), so
    # the hook's broadcast met the other ranks' wait for the profile. Every rank now calls it there, for the sample
    want, ranks = _check("reloaded_every_epoch", runs)
    assert want["record"]["loaders_built"] == 3  # once per epoch
    assert [got["record"]["loaders_built"] for got in ranks] == [4, 4]  # and once more at setup, on every rank


def test_a_loader_built_from_state_set_in_on_fit_start_is_the_one_device_loader(runs):
    # before: the loader built at setup for the profile was handed to Lightning, so the pipeline trained on level 0's
    # data (0.144 off one device, silently); the hook also draws its data at random, which the early call must not
    # shift (it runs with the generators put back)
    want, ranks = _check("loader_state_set_in_on_fit_start", runs)
    assert want["record"]["levels"] == [1]
    assert [got["record"]["levels"] for got in ranks] == [[0, 1], [0, 1]]


def test_two_validation_loaders_log_each_loaders_value_as_on_one_device(runs):
    want, _ = _check("two_validation_loaders", runs)  # the same keys and values on every rank
    assert {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"} <= set(want["metrics"])


def test_a_value_logged_on_rank_zero_only_equals_one_devices(runs):
    want, ranks = _check("log_rank_zero_only", runs)
    assert "train_loss" in want["metrics"]


def test_min_epochs_holds_early_stopping_back_to_the_one_device_epoch(runs):
    want, _ = _check("min_epochs", runs)  # every rank stops at the same epoch
    assert want["epochs"] == 3  # early stopping would have stopped after the first


def test_autocast_in_the_step_tracks_the_one_device_run_within_a_bfloat16_rounding(runs):
    # the stages run the user's autocast (recomputed passes too: with chunks=1 every weight is equal, measured);
    # bfloat16 matmuls over micro-batches of 4 round otherwise than over the batch of 8 (measured: 4.0e-4)
    reference, pipelined = runs
    want = reference["autocast_in_step"]
    for got in (rank["autocast_in_step"] for rank in pipelined):
        assert (got["steps"], got["epochs"]) == (want["steps"], want["epochs"])
        assert _same_weights(got["weights"], want["weights"]) <= 2e-3
        assert got["weights"]["backbone.0.weight"].dtype == torch.float32


def test_outer_layers_changed_on_rank_zero_only_are_taken_from_the_first_stage_with_a_warning_naming_them(runs):
    # a rank-zero-only callback rescaled the head, and the module's own hook reset a stem statistic on rank 0: each
    # stage went on with its own copy, computing its loss and gradients from it (checked: the weights end apart)
    want, ranks = _check("rank_zero_weight_changes", runs)
    said = [m for m in ranks[0]["warnings"] if "layers outside the backbone" in m]
    assert len(said) == 1, ranks[0]["warnings"]  # said once, though the callback changes the head every batch
    assert said[0].startswith("Before training batch 1, the layers outside the backbone on rank(s) [1] differed from")
    assert "`head.weight`" in said[0] and "`head.bias`" not in said[0] and "`@rank_zero_only`" in said[0]
    assert not any("outside the backbone" in m for m in [*ranks[1]["warnings"], *want["warnings"]])


def test_weights_loaded_after_the_split_train_as_on_one_device_with_a_warning_against_drawing_them_there(runs):
    # fixed values loaded in on_fit_start equal one device's; the strategy cannot tell them from values drawn at
    # random where the stages drew alike, so rank 0 says where random ones belong
    want, ranks = _check("weights_loaded_in_on_fit_start", runs)
    said = [m for m in ranks[0]["warnings"] if "code changed the backbone's weights" in m]
    assert len(said) == 1 and "on stage 0 (rank 0) and stage 1 (rank 1)" in said[0], ranks[0]["warnings"]
    assert "`__init__`, `setup()` or `configure_model()`" in said[0]
    others = [*ranks[1]["warnings"], *want["warnings"]]
    assert not any("backbone's weights" in m for m in others), others


def test_the_learning_rate_finder_suggests_the_one_device_rate_and_the_fit_after_it_trains_as_one_device(runs):
    # Lightning's tuner ends its search fit with an exception of its own; taken for a failure, it left the
    # backbone partitioned, and the fit after it waited forever for the other stage
    want, ranks = _check("lr_finder", runs)
    found = want["record"]["lr_find"]
    assert found["suggestion"] is not None and found["lr"] == found["suggestion"] != 0.01  # the finder set it
    for got in ranks:
        assert got["record"]["lr_find"]["lr"] == pytest.approx(found["lr"], rel=1e-9)
        assert got["record"]["lr_find"]["losses"] == pytest.approx(found["losses"], abs=1e-6)


def test_throughput_monitor_counts_each_sample_once_and_the_flops_per_device(runs):
    # Lightning multiplies each process's counts by the world size, as if every process were a data-parallel
    # device: a pipeline's 2 processes see the same batches, so its totals were twice the samples trained
    want, ranks = _check("throughput_monitor", runs)
    got = ranks[0]["logged"]
    keys = lambda rows: sorted({k for row in rows for k in row})  # noqa: E731
    assert keys(got) == keys(want["logged"])  # one pipeline, like one device: no job totals besides the device's
    assert "train/device/samples_per_sec" in keys(got) and not any(k.startswith("train/samples_per") for k in keys(got))
    for name in ("train/samples", "train/batches"):
        assert [row.get(name) for row in got] == [row.get(name) for row in want["logged"]], name
    rates = [row for row in got if "train/device/flops_per_sec" in row]
    assert rates  # the whole model's flops per batch, spread over the 2 stages' devices
    for row in rates:
        per_device = float(row["train/device/batches_per_sec"]) * 1000.0 / 2
        assert float(row["train/device/flops_per_sec"]) == pytest.approx(per_device, rel=1e-6)
    for row in want["logged"]:
        if "train/device/flops_per_sec" in row:
            one = float(row["train/device/batches_per_sec"]) * 1000.0
            assert float(row["train/device/flops_per_sec"]) == pytest.approx(one, rel=1e-6)


def test_validate_test_predict_and_a_second_fit_on_the_same_trainer_after_fit_match_one_device(runs):
    want, ranks = _check("same_trainer_after_fit", runs)  # the weights after the second fit, its steps and epoch
    assert want["epochs"] == 3  # the second fit ran its extra epoch
    for got in ranks:
        _same_evaluations(got["record"], want["record"])


def test_early_stopping_stops_every_stage_at_the_one_device_epoch(runs):
    want, ranks = _check("early_stopping", runs)
    assert want["epochs"] < 6  # it did stop early


def test_metrics_sum_cat_accuracy_sync_dist_and_all_gather_count_each_sample_once(runs):
    want, ranks = _check("metrics", runs)
    for got in ranks:
        assert got["record"]["samples_seen"] == want["record"]["samples_seen"] == [32.0, 64.0]  # not 2x per stage
        assert got["record"]["val_targets"] == want["record"]["val_targets"]  # CatMetric: each sample once
        assert len(want["record"]["val_targets"]) == 16
        assert got["record"]["callback"] == want["record"]["callback"]  # a callback's metrics, once per sample too
        assert [seen for seen, _, _ in want["record"]["callback"]] == [32.0, 64.0]
        assert got["record"]["after_fit"] == want["record"]["after_fit"] == 64.0  # and once `fit` returned
        # one pipeline is one data-parallel rank: all_gather stacks one row, as DDP with one process does
        assert set(got["record"]["all_gather_shapes"]) == {(1,)}
    assert not math.isnan(want["metrics"]["val_acc"].item())


def test_csv_logger_and_learning_rate_monitor_write_the_one_device_rows_on_rank_zero(runs):
    want, ranks = _check("loggers_and_lr_monitor", runs)
    assert ranks[1]["logged"] is None  # loggers write on rank zero only
    got = ranks[0]["logged"]
    assert [sorted(row) for row in got] == [sorted(row) for row in want["logged"]]
    assert any("lr-SGD" in row for row in got)
    for row, expected in zip(got, want["logged"]):
        for key, value in expected.items():
            assert float(row[key]) == pytest.approx(float(value), abs=1e-6), key


def test_metrics_and_seeded_workers_over_two_replicas_of_two_stages_equal_ddp_over_two_processes():
    names = ["metrics", "workers_seeded_by_lightning", "contrastive_all_gather"]
    ddp = run_ok(_compat.ddp, 2, names, timeout=600)
    pipelined = run_ok(_compat.pipelined_replicas, 4, names, timeout=600)
    # each replica's workers draw the augmentations of the DDP rank of the same index: the same weights
    for rank, got in enumerate(r["workers_seeded_by_lightning"] for r in pipelined):
        assert _same_weights(got["weights"], ddp[rank // 2]["workers_seeded_by_lightning"]["weights"]) <= 1e-6
    # a contrastive loss over both replicas' features, gathered with their gradients: DDP's weights
    for rank, got in enumerate(r["contrastive_all_gather"] for r in pipelined):
        assert _same_weights(got["weights"], ddp[rank // 2]["contrastive_all_gather"]["weights"]) <= 1e-6
    want = ddp[0]["metrics"]
    assert want["record"]["samples_seen"] == [32.0, 64.0]  # the sum over both data-parallel ranks
    for rank, got in enumerate(r["metrics"] for r in pipelined):
        replica = rank // 2
        expected = ddp[replica]["metrics"]
        assert _same_weights(got["weights"], expected["weights"]) <= 1e-6
        assert got["record"]["samples_seen"] == expected["record"]["samples_seen"]
        assert got["record"]["val_targets"] == expected["record"]["val_targets"]  # gathered over the replicas
        assert got["record"]["callback"] == expected["record"]["callback"]  # so are a callback's metrics
        assert got["record"]["after_fit"] == expected["record"]["after_fit"]
        assert got["record"]["all_gather_shapes"] == expected["record"]["all_gather_shapes"] == [(2,)] * 2
        for key, value in expected["metrics"].items():
            torch.testing.assert_close(got["metrics"][key], value, atol=1e-6, rtol=0, msg=key)


def test_test_validate_and_predict_with_ckpt_path_best_load_the_one_device_checkpoint(runs):
    want, ranks = _check("best_checkpoint", runs)  # the weights of the best epoch, loaded on every rank
    assert want["record"]["best"] != f"epoch={want['epochs'] - 1}-step={want['steps']}.ckpt"  # not the last epoch
    for got in ranks:
        assert got["record"]["best"] == want["record"]["best"]  # the same epoch chosen
        _same_evaluations(got["record"], want["record"])


@pytest.mark.parametrize(
    "name, dtype, unit",
    [("bf16_true", torch.bfloat16, 2**-8), ("half_true", torch.float16, 2**-10)],
    ids=["bf16_true", "half_true"],
)
def test_bf16_true_and_16_true_track_the_one_device_run_within_a_rounding(runs, name, dtype, unit):
    # the weights and their gradients are bfloat16 (float16): a stage adds its micro-batches' gradients in that
    # type, which rounds otherwise than one device's whole-batch gradient (measured, max |dw|: 2.0e-3 in bfloat16,
    # 3.7e-4 in float16, relative 7.4e-3 and 2.4e-3: a unit or two in the last place)
    reference, pipelined = runs
    want = reference[name]
    for got in (rank[name] for rank in pipelined):
        assert (got["steps"], got["epochs"]) == (want["steps"], want["epochs"])
        assert list(got["weights"]) == list(want["weights"])
        for key, value in want["weights"].items():
            assert value.dtype == got["weights"][key].dtype == dtype, key
            torch.testing.assert_close(got["weights"][key], value, rtol=2 * unit, atol=unit / 2, msg=key)
        for key, value in want["metrics"].items():
            torch.testing.assert_close(got["metrics"][key].float(), value.float(), rtol=4 * unit, atol=0, msg=key)
