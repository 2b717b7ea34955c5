"""Pipeline x data parallel: 2 replicas of a 2-stage pipeline over 4 real processes."""

from __future__ import annotations

import os

import _models as M
import _replicas as R
import pytest
import torch

from lightning_gpipe.launch import run_ok, run_processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ok(R.replicas, 4, str(tmp_path_factory.mktemp("replicas")), timeout=600)


def _close(got, expected, atol=1e-6):
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=lambda m: f"{key}: {m}")


def test_two_replicas_of_two_stages_equal_one_device_on_the_global_batch(runs):
    reference = R.one_device_on_the_global_batch()
    for rank in range(4):
        _close(runs[rank]["2x2"]["weights"], reference["weights"])
    grads = {**runs[0]["2x2"]["grads"], **runs[1]["2x2"]["grads"]}  # stage 0 and stage 1 of replica 0
    _close(grads, reference["grads"])
    # each replica trains on its own half: the two pipelines logged different losses...
    assert runs[0]["2x2"]["losses"] != runs[2]["2x2"]["losses"]
    # ...whose mean is the loss of the global batch
    mean = [(a + b) / 2 for a, b in zip(runs[0]["2x2"]["losses"], runs[2]["2x2"]["losses"])]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(reference["losses"]), atol=1e-6, rtol=0)


def test_tied_weights_in_two_replicas_of_two_stages_equal_one_device_on_the_global_batch(runs):
    reference = R.one_device_on_the_global_batch(tied=True, optimizer="adam")
    for rank in range(4):
        _close(runs[rank]["2x2 tied"]["weights"], reference["weights"])
    # every holder of a tie got the whole gradient: the sum over its stages, averaged over the replicas
    for rank in range(4):
        for name in ("backbone.0.weight", "backbone.2.bias"):
            if name in runs[rank]["2x2 tied"]["grads"]:
                torch.testing.assert_close(
                    runs[rank]["2x2 tied"]["grads"][name], reference["grads"][name], atol=1e-6, rtol=0
                )
    # stage 1 holds its copies under the names of its own layers: the same gradients as the canonical ones
    aliases = {"backbone.6.weight": "backbone.0.weight", "backbone.6.bias": "backbone.2.bias"}
    grads = {**runs[0]["2x2 tied"]["grads"], **runs[1]["2x2 tied"]["grads"]}
    for alias, name in aliases.items():
        torch.testing.assert_close(grads.pop(alias), reference["grads"][name], atol=1e-6, rtol=0)
    _close(grads, reference["grads"])


@pytest.mark.parametrize(
    "name, model",
    [
        ("2x2 stop gradient", dict(stop_gradient=True, stem=True, optimizer="adamw")),
        ("2x2 tied, output detached", dict(tied=True, optimizer="adamw", detach_output=True)),
    ],
)
def test_parameters_no_replica_has_a_gradient_for_keep_none_as_on_one_device(runs, name, model):
    reference = R.one_device_on_the_global_batch(**model)
    assert "backbone.0.weight" not in reference["grads"]  # one device gives them no gradient at all
    for rank in range(4):
        _close(runs[rank][name]["weights"], reference["weights"])
    _close({**runs[0][name]["grads"], **runs[1][name]["grads"]}, reference["grads"])


def test_logged_metrics_are_reduced_over_the_replicas_not_the_stages(runs):
    last = (runs[0]["2x2"]["losses"][-1] + runs[2]["2x2"]["losses"][-1]) / 2
    for rank in range(4):
        assert runs[rank]["2x2"]["logged"] == pytest.approx(last, abs=1e-6)  # self.log(..., sync_dist=True)
        assert runs[rank]["sum over replicas"] == (0 + 2 if rank % 2 == 0 else 1 + 3)  # stage k: ranks k and k+2


def test_a_prediction_writer_writes_one_file_per_replica_from_its_first_stage_each_sample_once(runs):
    """As under DDP: one file per data-parallel shard, written by the pipeline's first stage; every sample once."""
    directory = runs[0]["written"]
    firsts = [rank for rank, result in enumerate(runs) if result["first stage"]]
    assert len(firsts) == 2
    assert sorted(os.listdir(directory)) == sorted(f"predictions_{rank}.pt" for rank in firsts)
    indices, rows = [], 0
    for rank in firsts:
        saved = torch.load(os.path.join(directory, f"predictions_{rank}.pt"))
        indices += [i for batch in saved["indices"][0] for i in batch]
        rows += sum(p.shape[0] for p in saved["predictions"])
    samples = len(M.loader().dataset)
    assert sorted(indices) == list(range(samples)) and rows == samples


def test_batch_norm_statistics_in_and_outside_the_backbone_are_the_first_replicas_as_ddps_broadcast_makes_them(runs):
    # before: each replica kept the running statistics its own data moved (0.0586 off DDP's on replica 1, a synced
    # validation loss 0.068 off); DDP broadcasts rank 0's before a forward, skipping the one after a validation or an
    # accumulating step, which a validation every 2 steps and accumulation over 2 batches exercise here
    for rank in range(4):  # weights and buffers, rank by rank: the last step moves each rank's statistics, as in DDP
        _close(runs[rank]["pipe_size=1 batch norm"]["weights"], runs[rank]["ddp batch norm"]["weights"])
        assert {"stem.1.running_mean", "backbone.0.running_mean"} <= set(runs[rank]["ddp batch norm"]["weights"])


@pytest.mark.parametrize("stage", ["predict", "validate"])
def test_an_evaluation_whose_replicas_get_different_batch_counts_is_refused_on_every_rank_naming_them(stage):
    # before: the replica with fewer batches finished and left the others in the end-of-batch agreement, which ended
    # 24-51 s later on "lost the connection ... (killed by a signal ...)" or a deadlock error, naming no cause
    outcome = run_processes(R.uneven_evaluation, 4, stage, timeout=120)
    assert all(code not in (0, None) for code in outcome.exitcodes), outcome.exitcodes
    kind = {"predict": "predict", "validate": "validation"}[stage]
    for error in outcome.errors:
        assert error.startswith(
            f"ValueError: The data-parallel replicas would run different numbers of {kind} batches per loader "
            "(replica 0: [2], replica 1: [1])"
        ), error
        assert "a multiple of the batch size times the replicas" in error


def test_a_modules_metric_syncs_over_every_rank_when_ddp_validates_it_after_the_pipelined_fit(runs):
    # its sync function kept the pipeline's replica group: DDP's validation counted 20 samples (2 of 4 ranks) of 40;
    # and a one-device validation in each of the same processes, whose default group is still up, counts its own 40
    for rank in range(4):
        assert runs[rank]["ddp validates after the pipeline"] == (40.0, 40.0)


def test_pipe_size_1_is_lightnings_ddp(runs):
    for rank in range(4):
        _close(runs[rank]["pipe_size=1"]["weights"], runs[rank]["ddp"]["weights"])
        _close(runs[rank]["pipe_size=1"]["weights"], runs[0]["ddp"]["weights"])


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_checkpoint_and_exact_resume_in_the_2x2_layout(runs, kind):
    straight = runs[0][f"straight {kind}"]["weights"]
    if kind == "full":
        for rank in range(4):
            _close(runs[rank][f"resumed {kind}"]["weights"], straight, atol=0)
    else:  # after a sharded run each rank holds its own stage (and the head); the other stage's layers are meta
        for replica in (0, 1):
            held = set()
            for rank in (2 * replica, 2 * replica + 1):
                weights = runs[rank][f"resumed {kind}"]["weights"]
                assert set(weights) == set(straight)
                own = {k: v for k, v in weights.items() if not v.is_meta}
                _close(own, {k: straight[k] for k in own}, atol=0)
                held |= set(own)
            assert held == set(straight)  # the two stages of a replica hold the whole model between them
    files = runs[0]["files"][kind]
    assert files == ["step=3.ckpt"]


def test_replicas_given_different_checkpoint_files_all_load_rank_zeros_as_ddps_model_holds(runs):
    # before, each replica restored its own file after setup and the replicas trained apart from then on
    for rank, results in enumerate(runs):
        _close(results["resumed, replica 1 given another file"]["weights"], runs[0]["resumed full"]["weights"])
        warned = results["other file warnings"]
        assert len(warned) == (1 if rank >= 2 else 0), (rank, warned)
        if warned:
            assert f"Rank {rank} was given the checkpoint" in warned[0] and "sync_dist=True" in warned[0]


def test_sparse_gradients_in_replicas_are_refused_before_any_batch_naming_the_layer_and_the_fixes(runs):
    # before: torch's "reshape is not implemented for sparse tensors" from the gradient average at the first step
    for rank_results in runs:
        for name, layer in (("sparse engine", "`0`"), ("sparse strategy", "`lookup`")):
            message = rank_results[name]
            assert message is not None and message.startswith(f"{layer} makes sparse gradients (`sparse=True`)")
            assert "2 data-parallel replicas" in message and "`sparse=False`" in message and "one pipeline" in message


def test_a_sparse_gradient_the_setup_check_does_not_know_is_refused_where_replicas_or_tied_copies_add_it():
    from lightning_gpipe.engine.replicas import with_presence

    dense = torch.nn.Parameter(torch.zeros(3))
    table = torch.nn.Parameter(torch.zeros(5, 2))
    grad = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 2), (5, 2))
    assert with_presence([torch.ones(3), None], [dense, table]).tolist() == [1, 1, 1] + [0] * 10 + [1, 0]
    with pytest.raises(RuntimeError, match=r"layout torch.sparse_coo, which neither .* nor the sum of a tied"):
        with_presence([torch.ones(3), grad], [dense, table])
