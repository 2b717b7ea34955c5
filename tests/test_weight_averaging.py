"""Weight averaging (SWA, EMA) over a real 2-stage pipeline gives the one-device result; ModelPruning is refused."""

from __future__ import annotations

import os

import _models as M
import _weight_averaging as W
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.launch import run_ok, run_processes

STAGES = 2
RUNS = {run.name: run for run in W.RUNS}
#: what a checkpoint of an averaging run holds of the model: the averaged or current weights, the averaging state
MODEL_ENTRIES = ("state_dict", "current_model_state", "averaging_state")


@pytest.fixture(scope="module")
def directories(tmp_path_factory) -> tuple[str, str]:
    return str(tmp_path_factory.mktemp("pipeline")), str(tmp_path_factory.mktemp("one_device"))


@pytest.fixture(scope="module")
def pipeline(directories) -> list[dict]:
    """Every rank's results of every run, in one spawn of K=2 processes."""
    return run_ok(W.sweep, STAGES, directories[0], timeout=600)


@pytest.fixture(scope="module")
def one_device(directories) -> dict[str, dict]:
    """The same runs on one device without the pipeline (a resumed run after the run it resumes)."""
    torch.set_num_threads(1)
    return {run.name: W.fit(run, directories[1]) for run in W.RUNS}


def _close(got, expected, what: str) -> None:
    """Equal structure, tensors within 1e-6."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=lambda m: f"{what}: {m}")
    elif isinstance(expected, dict):
        assert list(got) == list(expected), f"{what}: keys {list(got)} != {list(expected)}"
        for key in expected:
            _close(got[key], expected[key], f"{what}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), what
        for i, (g, e) in enumerate(zip(got, expected)):
            _close(g, e, f"{what}[{i}]")
    else:
        assert got == expected, f"{what}: {got!r} != {expected!r}"


def _averaging_state(checkpoint: dict) -> dict:
    """The checkpoint's entries of the averaging callback (ModelCheckpoint's own state names its directory)."""
    return {k: v for k, v in checkpoint["callbacks"].items() if "WeightAveraging" in k}


@pytest.mark.parametrize("name", list(RUNS))
def test_weights_after_fit_are_the_one_device_average_on_every_rank(name, pipeline, one_device):
    expected = one_device[name]
    assert expected["weights"] != {}
    for rank, results in enumerate(pipeline):
        got = results[name]
        _close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), f"rank {rank} losses")
        _close(got["weights"], expected["weights"], f"rank {rank} LightningModule weights after fit")


@pytest.mark.parametrize("name", list(RUNS))
def test_the_averaged_model_is_whole_and_equal_to_one_devices_on_every_rank(name, pipeline, one_device):
    for rank, results in enumerate(pipeline):
        assert results[name]["whole average"], f"rank {rank}: the averaged backbone was not reassembled"
        _close(results[name]["average"], one_device[name]["average"], f"rank {rank} averaged model after fit")


@pytest.mark.parametrize("name", list(RUNS))
def test_every_epochs_checkpoint_holds_the_one_device_averages(name, directories):
    """Each epoch's file: the model state (EMA: the average, and the current weights beside it) and the callback's
    state (SWA: the averaged model and its count), against the one-device run's file of the same epoch."""
    got_dir, expected_dir = (os.path.join(d, name) for d in directories)
    files = sorted(os.listdir(expected_dir))
    epochs = W.EPOCHS + (name.startswith("swa batchnorm"))  # SWA adds an epoch that recomputes BatchNorm statistics
    first = 2 if name.endswith("resumed") else 0
    assert files == [f"epoch={e}.ckpt" for e in range(first, epochs)]
    assert sorted(os.listdir(got_dir)) == files
    for file in files:
        got = torch.load(os.path.join(got_dir, file), weights_only=True)
        expected = torch.load(os.path.join(expected_dir, file), weights_only=True)
        for entry in MODEL_ENTRIES:
            assert (entry in got) == (entry in expected), f"{file}: {entry}"
            if entry in expected:
                _close(got[entry], expected[entry], f"{file} {entry}")
        _close(_averaging_state(got), _averaging_state(expected), f"{file} callback state")


def test_swa_averages_from_swa_epoch_start_as_on_one_device(directories):
    """The averaged model in the checkpoints moves from `swa_epoch_start` on and differs from the current weights."""
    path = os.path.join(directories[0], "swa")
    states = [
        next(iter(_averaging_state(torch.load(os.path.join(path, f"epoch={e}.ckpt"), weights_only=True)).values()))
        for e in range(W.EPOCHS)
    ]
    assert [s["n_averaged"] for s in states] == [0, 1, 2, 3]  # swa_epoch_start=2: the second epoch's start
    last = torch.load(os.path.join(path, f"epoch={W.EPOCHS - 1}.ckpt"), weights_only=True)
    for key in ("backbone.0.weight", "backbone.6.weight", "head.1.weight"):  # both stages and the head
        assert not torch.equal(states[-1]["average_model_state"][key], last["state_dict"][key]), key


def test_ema_checkpoints_hold_the_average_of_every_stage_and_the_current_weights(directories):
    last = torch.load(os.path.join(directories[0], "ema", f"epoch={W.EPOCHS - 1}.ckpt"), weights_only=True)
    assert list(last["state_dict"]) == list(last["current_model_state"])
    for key in ("backbone.0.weight", "backbone.6.weight", "head.1.weight"):
        assert not torch.equal(last["state_dict"][key], last["current_model_state"][key]), key


def test_tied_weights_stay_tied_in_the_reassembled_average(pipeline, one_device):
    assert one_device["ema tied"]["tied"]
    for rank, results in enumerate(pipeline):
        assert results["ema tied"]["tied"], f"rank {rank}: the averaged copies of a tie are not one Parameter again"


def test_ema_validates_with_the_averaged_weights_during_and_after_fit(pipeline, one_device):
    """EMA swaps the average into the pipelined model for validation; a later `validate` cuts its copy again."""
    expected = one_device["ema"]
    for rank, results in enumerate(pipeline):
        got = results["ema"]
        for key in ("val_loss", "validate after fit"):
            _close(torch.tensor(got[key]), torch.tensor(expected[key]), f"rank {rank} {key}")
        assert got["whole average after validate"], f"rank {rank}: the averaged backbone was not reassembled"


def test_a_module_fit_by_the_pipeline_is_deep_copied_by_a_second_fits_averaging_and_pickles(pipeline):
    # the strategy gave the module's metric the replica group itself: EMA's setup in the second fit failed with
    # "cannot pickle 'ProcessGroup' object"; the metric now holds a sync function of the package's instead
    one = W.fit_again()
    for results in pipeline:
        got = results["fit again"]
        _close(got["weights"], one["weights"], "weights after the second fit")
        assert got["accuracy"] == pytest.approx(one["accuracy"], abs=1e-6)


def test_model_pruning_is_refused_at_setup_on_every_rank(pipeline):
    for rank, results in enumerate(pipeline):
        refusal = results["pruning"]
        assert refusal["steps"] == 0, f"rank {rank} trained before the refusal"
        assert refusal["error"] is not None, f"rank {rank} was not refused"
        assert refusal["error"].startswith("ModelPruning is not supported by the gpipe strategy"), refusal["error"]
        assert "Prune after `fit`" in refusal["error"] and "torch.nn.utils.prune" in refusal["error"]


def _ended_with(copied: bool) -> list[str]:
    outcome = run_processes(W.average_used_during_fit, 2, copied, timeout=120)
    assert all(code not in (None, 0) for code in outcome.exitcodes), outcome.exitcodes
    assert outcome.seconds < 60 and all(outcome.errors), (outcome.seconds, outcome.errors)
    return outcome.errors


def test_a_copy_of_the_live_backbone_during_a_fit_ends_every_rank_naming_the_averaging_that_works():
    # AveragedModel(pl_module.backbone) in a callback's on_fit_start: torch's own error named a PrefixStore
    for rank, error in enumerate(_ended_with(copied=True)):  # each rank meets it in the same hook, before any wait
        assert error.startswith("TypeError: A copy (copy.deepcopy, pickle) was asked of a backbone partitioned"), error
        assert f"this process holds only stage {rank} (layers" in error
        assert "EMAWeightAveraging" in error and "in the LightningModule's __init__" in error


def test_an_average_made_in_init_that_runs_during_the_fit_ends_every_rank_saying_it_holds_one_stage():
    # the strategy cut the copy like the pipe, so that update_parameters pairs each stage's layers with their copies
    for rank, error in enumerate(_ended_with(copied=False)):
        assert error.startswith(f"RuntimeError: This is stage {rank}'s part of a copy of the pipelined backbone"), error
        assert "cannot run" in error and "EMAWeightAveraging" in error


def test_weight_averaging_with_sharded_checkpoints_is_refused_at_setup():
    model = M.Net()
    trainer = L.Trainer(
        strategy=GPipeStrategy(state_dict_type="sharded"),
        devices=1,
        callbacks=[EMAWeightAveraging()],
        **M.trainer_kwargs(max_steps=1),
    )
    with pytest.raises(
        ValueError,
        match=r"EMAWeightAveraging is not supported with .*state_dict_type='sharded'.*"
        r"Use state_dict_type='full'",
    ):
        trainer.fit(model, M.loader())
    assert model.losses == []
