"""Checkpoints: exact resume, re-partition, sharded files, one-device interop; failures end every rank."""

from __future__ import annotations

import os

import pytest
import torch

import _models as M
import _resume as R
from _launch import run_ok, run_processes
from lightning_gpipe.checkpoint import consolidate


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn of 3 stages writes checkpoints; one spawn of 2 stages does all the resuming."""
    directory = str(tmp_path_factory.mktemp("resume"))
    one = R.one_device("adam", max_steps=5, save_every=5, directory=os.path.join(directory, "one"))
    run_ok(R.save_for_repartition, 3, directory, timeout=300)
    results = run_ok(R.resume_everything, 2, directory, os.path.join(directory, "one", "step=5.ckpt"), timeout=600)
    return {"pipeline": results, "one device": one, "directory": directory}


def assert_same_weights(got, expected, atol=1e-6):
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stop", [3, 5], ids=["mid-epoch", "epoch-end"])
def test_resume_continues_exactly_as_if_never_stopped(runs, optimizer, stop):
    # dropout inside and outside the pipe, shuffled data, a step LR schedule: all must resume in place
    for rank_results in runs["pipeline"]:
        straight = rank_results[f"straight {optimizer}"]["weights"]
        resumed = rank_results[f"resumed {optimizer} at {stop}"]
        assert_same_weights(resumed["weights"], straight, atol=0)
        assert len(resumed["losses"]) == R.STEPS - stop


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_checkpoint_of_three_stages_resumes_on_two_with_another_balance(runs, kind):
    straight = runs["pipeline"][0]["straight adam"]["weights"]
    assert_same_weights(runs["pipeline"][0][f"from k3 {kind}"]["weights"], straight, atol=0)


def test_sharded_checkpoint_is_a_directory_of_stage_files_that_consolidates_for_one_device(runs, tmp_path):
    path = os.path.join(runs["directory"], "sharded-k3", "step=3.ckpt")
    assert os.path.isdir(path) and os.path.exists(os.path.join(path, "meta.pt"))
    assert len([f for f in os.listdir(path) if f.endswith(".distcp")]) == 3  # one file per stage
    checkpoint = consolidate(path)
    assert list(checkpoint["state_dict"]) == list(M.Net(**R.RANDOM).state_dict())
    torch.save(checkpoint, tmp_path / "full.ckpt")
    model = M.Net.load_from_checkpoint(tmp_path / "full.ckpt", **R.RANDOM)
    full = torch.load(os.path.join(runs["directory"], "full-k3", "step=3.ckpt"), weights_only=False)
    assert_same_weights(model.state_dict(), full["state_dict"], atol=0)


def test_one_device_checkpoint_starts_a_pipeline_run(runs):
    straight = R.one_device("adam", max_steps=R.STEPS)["weights"]
    assert_same_weights(runs["pipeline"][0]["from one device"]["weights"], straight)


def test_pipeline_checkpoint_resumes_a_plain_one_device_run(runs):
    path = runs["pipeline"][0]["for one device"]
    saved = torch.load(path, weights_only=False)
    names = saved["optimizer_states"][0]["param_groups"][0]["param_names"]
    assert names == [n for n, _ in M.Net().named_parameters()]  # numbered as a one-device optimizer numbers them
    resumed = R.one_device("adam", max_steps=R.STEPS, ckpt_path=path, seed=1)["weights"]
    assert_same_weights(resumed, R.one_device("adam", max_steps=R.STEPS)["weights"])


# -- failures --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages, victim, how", [(2, 1, "kill"), (3, 0, "kill"), (3, 2, "freeze")])
def test_a_killed_or_frozen_rank_ends_every_other_rank_with_its_stage_named(stages, victim, how):
    survivors = [r for r in range(stages) if r != victim]
    outcome = run_processes(R.sabotaged_fit, stages, victim, how, timeout=90, wait_for=survivors)
    for rank in survivors:
        assert outcome.exitcodes[rank] == 1, (rank, outcome.exitcodes, outcome.errors)  # an error, not an abort
        error = outcome.errors[rank] or ""
        assert f"stage {victim} (rank {victim})" in error, error
        assert outcome.ended[rank] < 60  # process start-up included
    if how == "freeze":  # noticed by the heartbeat (failure_timeout=3 s), not by a closed connection
        assert "stopped responding" in outcome.errors[survivors[0]]


def test_a_crash_while_saving_leaves_the_last_good_checkpoint(tmp_path):
    outcome = run_processes(R.crash_while_saving, 2, str(tmp_path), timeout=90)
    assert outcome.exitcodes[0] == 1  # rank 0 died in the middle of its second save
    assert outcome.exitcodes[1] not in (0, None)  # and rank 1 did not hang
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)  # the first save, whole
    assert checkpoint["global_step"] == 2
    leftovers = [f for f in os.listdir(tmp_path) if f != "last.ckpt"]
    assert all(".tmp-" in f for f in leftovers), leftovers  # the half-written file kept its temporary name
