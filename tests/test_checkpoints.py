"""Checkpoints: exact resume, re-partition, sharded files, one-device interop; failures end every rank."""

from __future__ import annotations

import os

import _models as M
import _resume as R
import pytest
import torch

from lightning_gpipe.checkpointing.files import consolidate
from lightning_gpipe.launch import run_ok, run_processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn of 3 stages writes checkpoints; one spawn of 2 stages does all the resuming."""
    directory = str(tmp_path_factory.mktemp("resume"))
    one = R.one_device("adam", max_steps=5, save_every=5, directory=os.path.join(directory, "one"))
    saved = run_ok(R.save_for_repartition, 3, directory, timeout=300)
    results = run_ok(R.resume_everything, 2, directory, os.path.join(directory, "one", "step=5.ckpt"), timeout=1200)
    return {"pipeline": results, "one device": one, "directory": directory, "saved": saved}


def test_after_a_sharded_run_the_modules_state_dict_refuses_naming_the_stage_and_consolidate(runs):
    # each process keeps its own stage and the others' layers on meta, which torch.save writes without complaint
    for rank, saved in enumerate(runs["saved"]):
        assert saved["full"]["refused"] is None  # after a full run the whole model is back on every rank
        message = saved["sharded"]["refused"]
        assert message is not None and message.startswith(
            f"state_dict() after a run with state_dict_type='sharded': this process kept only stage {rank}'s"
        )
        assert "lightning_gpipe.checkpointing.consolidate(path)" in message


def test_the_strategys_state_dict_is_the_whole_model_on_the_first_stage_and_empty_on_the_others_in_both_kinds(runs):
    # with state_dict_type="sharded" it gave each rank its own stage under the whole model's keys, silently (rank 0
    # got 2 of a 5-layer backbone's layers), though the README names it as the way to the whole model
    full, sharded = (runs["saved"][0][kind]["whole"] for kind in ("full", "sharded"))
    saved = torch.load(os.path.join(runs["directory"], "full-k3", "step=3.ckpt"), weights_only=True)["state_dict"]
    assert list(full) == list(saved)  # every key, in one device's order: what the checkpoint of that step holds
    assert_same_weights(full, saved, atol=0)
    assert_same_weights(sharded, full, atol=0)  # the same training: only the kind of checkpoint differs
    for rank in (1, 2):  # nothing, rather than a part that looks whole
        assert runs["saved"][rank]["full"]["whole"] == {} and runs["saved"][rank]["sharded"]["whole"] == {}


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


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_is_exact_when_configure_optimizers_reads_the_estimated_stepping_batches(runs, optimizer):
    # the property sets the training data up inside configure_optimizers, before the checkpoint is read: Lightning
    # went on with the iterator begun then, from the epoch's start (4.4e-2 off the uninterrupted run, as one device)
    for rank_results in runs["pipeline"]:
        straight = rank_results[f"straight {optimizer}"]["weights"]
        resumed = rank_results[f"resumed {optimizer} at 3 reading the estimated steps"]
        assert_same_weights(resumed["weights"], straight, atol=0)
        assert len(resumed["losses"]) == R.STEPS - 3


def test_checkpoint_of_three_stages_resumes_on_two_with_another_balance(runs):
    straight = runs["pipeline"][0]["straight adam"]["weights"]
    assert_same_weights(runs["pipeline"][0]["from k3 full"]["weights"], straight, atol=0)


def test_sharded_run_ends_with_each_rank_holding_its_own_trained_stage_and_the_rest_on_meta(runs):
    # K=2, balance [3, 6], state_dict_type="sharded": nothing is gathered at teardown
    straight = runs["pipeline"][0]["straight adam"]["weights"]
    for rank, rank_results in enumerate(runs["pipeline"]):
        weights = rank_results["from k3 sharded"]["weights"]
        assert list(weights) == list(straight)
        own = range(0, 3) if rank == 0 else range(3, 9)
        for key, value in weights.items():
            layer = int(key.split(".")[1]) if key.startswith("backbone.") else None
            if layer is None or layer in own:  # the head, or this stage's layers: trained, exact
                torch.testing.assert_close(value, straight[key], atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
            else:
                assert value.is_meta, (rank, key)


@pytest.fixture(scope="module")
def went_on(tmp_path_factory):
    return run_ok(R.go_on_after_a_fit, 2, str(tmp_path_factory.mktemp("go-on")), timeout=600)


def test_validate_predict_and_a_second_fit_after_a_sharded_run_go_on_from_each_stage_as_after_a_full_one(went_on):
    # before: the next run profiled the backbone for its split, and the other stages' meta layers failed it with
    # torch's "Cannot copy out of meta tensor" (the default balance; any split other than the run's failed so too)
    held = set()
    for rank_results in went_on:
        full, sharded = rank_results["full"], rank_results["sharded"]
        for what in ("validated", "from last"):
            got, expected = sharded[what][0]["val_loss"], full[what][0]["val_loss"]
            assert abs(got - expected) <= 1e-6, (what, got, expected)
        torch.testing.assert_close(sharded["predicted"], full["predicted"], atol=1e-6, rtol=0)
        assert set(sharded["weights"]) == set(full["weights"])
        for key, value in sharded["weights"].items():  # after the second fit: this stage's layers, the rest meta
            if not value.is_meta:
                held.add(key)
                torch.testing.assert_close(value, full["weights"][key], atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")
    assert held == set(went_on[0]["full"]["weights"])  # every layer trained on some rank


def test_a_validate_from_a_checkpoint_between_two_fits_leaves_the_next_fits_data_order_as_on_one_device(
    went_on, tmp_path
):
    # before: the validate's checkpoint load kept the training loader's saved position (and random state) for the
    # next training loader, so the second fit shuffled its epoch from the checkpoint's state, not the process's:
    # 6.0e-2 off one device after one more epoch, silently
    one = R.fit_validate_from_last_fit_again(1, str(tmp_path))
    for rank_results in went_on:
        assert_same_weights(rank_results["validated from last, fit again"], one)


def test_another_split_on_what_a_sharded_run_left_is_refused_naming_the_runs_split_and_consolidate(went_on):
    for rank_results in went_on:
        message = rank_results["refused"]
        assert message is not None and "state_dict_type='sharded' over 2 stages" in message
        assert "This run asks for 2 stages with balance=[1, 6]" in message
        assert "lightning_gpipe.checkpointing.consolidate(path)" in message


def test_meta_layers_are_refused_before_the_profile_and_a_sharded_leftover_goes_on_only_with_its_own_stages():
    from torch import nn

    from lightning_gpipe.checkpointing import sharded_leftover as S

    def backbone(meta_from: int) -> nn.Sequential:
        layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        for layer in layers[meta_from:]:
            layer.to("meta")
        return layers

    assert S.continue_from(backbone(4), "backbone", 2, 0, None) is None  # nothing on meta
    with pytest.raises(ValueError, match=r"Layers 2, 3 of `backbone` hold tensors on the meta device.*to_empty"):
        S.continue_from(backbone(2), "backbone", 2, 0, None)  # built on meta by the user: no run to go on from
    left = backbone(2)
    S.leave(left, [2, 2], 4, "never")
    assert S.continue_from(left, "backbone", 2, 0, "time") == S.Leftover((2, 2), 4, "never")
    with pytest.raises(ValueError, match=r"over 2 stages \(balance=\[2, 2\]\).*asks for 3 stages"):
        S.continue_from(left, "backbone", 3, 0, None)
    with pytest.raises(ValueError, match=r"no values for layers 2, 3 of its stage 1: another process ran it"):
        S.continue_from(left, "backbone", 2, 1, None)
    S.leave_in_main_process(left)
    with pytest.raises(ValueError, match=r"main process's copy .* start_method='popen'"):
        S.continue_from(left, "backbone", 2, 0, None)


def test_sharded_checkpoint_is_a_directory_of_stage_files_that_consolidates_for_one_device(runs, tmp_path):
    path = os.path.join(runs["directory"], "sharded-k3", "step=3.ckpt")
    assert os.path.isdir(path) and os.path.exists(os.path.join(path, "meta.json"))
    assert not [f for f in os.listdir(path) if f.endswith(".pt") and f != "meta_tensors.pt"]  # no pickled metadata
    assert len([f for f in os.listdir(path) if f.endswith(".distcp")]) == 3  # one file per stage
    checkpoint = consolidate(path)
    assert list(checkpoint["state_dict"]) == list(M.Net(**R.RANDOM).state_dict())
    torch.save(checkpoint, tmp_path / "full.ckpt")
    model = M.Net.load_from_checkpoint(tmp_path / "full.ckpt", **R.RANDOM)
    full = torch.load(os.path.join(runs["directory"], "full-k3", "step=3.ckpt"), weights_only=True)
    assert_same_weights(model.state_dict(), full["state_dict"], atol=0)


def test_resume_with_other_chunks_or_seed_warns_once_on_rank_zero_and_another_k_does_not(runs):
    first, second = runs["pipeline"]
    [message] = first["other chunks and seed"]["warned"]
    assert "chunks=4 (the checkpoint's: 2)" in message and "seed=5 (the checkpoint's: 0)" in message
    assert "(seed, call, micro-batch, layer)" in message and "GPipeStrategy(chunks=2)" in message
    assert second["other chunks and seed"]["warned"] == []  # rank 0 only
    for run in ("from k3 full", "from k3 sharded", "resumed adam at 3", "resumed sgd at 5"):  # another K, balance
        assert first[run]["warned"] == [], run


@pytest.mark.parametrize("optimizer", ["sgd-plain", "adam"])
def test_sharded_checkpoint_resumes_parameters_that_have_no_optimizer_state(runs, optimizer):
    # plain SGD keeps no state; Adam keeps none for the frozen first weight (it never gets a gradient)
    saved = runs["pipeline"][0][f"no state {optimizer} saved"]
    if optimizer == "sgd-plain":
        assert saved == []
    else:
        assert "backbone.0.weight" not in saved and "backbone.0.bias" in saved
    for rank_results in runs["pipeline"]:
        straight = rank_results[f"no state {optimizer} straight"]["weights"]
        assert_same_weights(rank_results[f"no state {optimizer} resumed"]["weights"], straight, atol=0)


def test_a_checkpoint_of_another_backbone_fails_on_every_rank_naming_missing_and_unexpected_keys(runs):
    outcome = run_processes(R.mismatched_resumes, 2, runs["directory"], timeout=300)
    assert all(error is None for error in outcome.errors), outcome.tracebacks
    for rank_results in outcome.results:
        for kind in ("full", "sharded"):
            more = rank_results[f"{kind} one more layer"]
            assert more is not None and "missing keys ['backbone.9.weight', 'backbone.9.bias']" in more, more
            assert "unexpected keys []" in more
            fewer = rank_results[f"{kind} one layer fewer"]
            # layer 1 (a Tanh) removed: the Linear layers 3, 5, 8 become 2, 4, 7
            assert (
                fewer is not None
                and "missing keys ['backbone.2.weight', 'backbone.2.bias', 'backbone.4.weight', "
                "'backbone.4.bias', 'backbone.7.weight', 'backbone.7.bias']"
                in fewer
            ), fewer
            assert "unexpected keys ['backbone.3.weight', 'backbone.3.bias', 'backbone.5.weight'" in fewer, fewer
            loose = rank_results[f"{kind} not strict"]
            full = torch.load(os.path.join(runs["directory"], "full-k3", "step=3.ckpt"), weights_only=True)
            for key, value in full["state_dict"].items():  # every saved entry loaded; the new layer kept its init
                torch.testing.assert_close(loose[key], value, atol=0, rtol=0)
            assert "backbone.9.weight" in loose


def test_one_device_checkpoint_starts_a_pipeline_run(runs):
    straight = R.one_device("adam", max_steps=R.STEPS)["weights"]
    assert_same_weights(runs["pipeline"][0]["from one device"]["weights"], straight)


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_pipeline_checkpoint_resumes_a_plain_one_device_run(runs, kind, tmp_path):
    # a sharded checkpoint through `consolidate`: its optimizer states stayed keyed by name, and the one-device
    # resume failed with torch's bare KeyError: 'param_groups'
    path = runs["pipeline"][0][f"for one device {kind}"]
    if kind == "sharded":
        torch.save(consolidate(path), tmp_path / "consolidated.ckpt")
        path = str(tmp_path / "consolidated.ckpt")
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


# -- durable files (in one process) ----------------------------------------------------------------------


def test_a_write_that_raises_removes_its_temporary_file_and_keeps_the_previous_checkpoint(tmp_path):
    from lightning_gpipe.checkpointing.files import atomic_write

    path = str(tmp_path / "last.ckpt")
    atomic_write(lambda tmp: torch.save({"step": 1}, tmp), path)

    def failing(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(failing, path)
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.load(path)["step"] == 1


def test_a_failed_sharded_write_removes_its_temporary_directory_and_keeps_the_previous_one(tmp_path):
    from lightning_gpipe.checkpointing.files import MetadataError, load_sharded, save_sharded

    path = str(tmp_path / "step=1.ckpt")
    save_sharded({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, path, writer=True)
    with pytest.raises(MetadataError, match=r"checkpoint\['hyper_parameters'\]\['fn'\]"):
        save_sharded({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {"fn": print}}, path, writer=True)
    with pytest.raises(RuntimeError, match="write failed"):

        def broken(*args, **kwargs):
            raise RuntimeError("write failed")

        import lightning_gpipe.checkpointing.files as C

        original, C.save_metadata = C.save_metadata, broken
        try:
            save_sharded({"state_dict": {"w": torch.zeros(2)}, "epoch": 1}, path, writer=True)
        finally:
            C.save_metadata = original
    assert os.listdir(tmp_path) == ["step=1.ckpt"]
    assert torch.equal(load_sharded(path, lambda keys: True)["state_dict"]["w"], torch.ones(2))


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "directory"])
def test_a_successful_write_fsyncs_the_files_then_the_folder_after_the_rename(tmp_path, monkeypatch, sharded):
    from lightning_gpipe.checkpointing import files as C

    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: renamed.append(len(synced)) or real_replace(a, b))
    path = str(tmp_path / "last.ckpt")
    if sharded:
        C.save_sharded({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, path, writer=True)
    else:
        C.atomic_write(lambda tmp: torch.save({"step": 1}, tmp), path)
    before, after = synced[: renamed[-1]], synced[renamed[-1] :]
    assert after == [str(tmp_path)]  # the folder, after the rename
    files = [p for p in before if os.path.basename(p) not in ("",) and ".tmp" in p]
    if sharded:
        assert {os.path.basename(p) for p in files} >= {"meta.json", "meta_tensors.pt", ".metadata", "__0_0.distcp"}
    else:
        assert len(files) == 1 and ".tmp-" in files[0]
