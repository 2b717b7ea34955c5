"""Random Sequentials (tuples, views, in-place and frozen layers) train in a pipeline as in one process, bare and
under random Trainer settings."""

from __future__ import annotations

import _random_lightning as RL
import _random_models as R
import pytest

from lightning_gpipe.launch import run_ok

SEEDS = list(range(24))
LIGHTNING_SEEDS = list(range(18))


@pytest.mark.parametrize("stages", [2, 4])
def test_random_sequentials_with_random_splits_chunks_and_checkpoint_modes_train_as_in_one_process(stages):
    ranks = run_ok(R.compare, stages, SEEDS, timeout=300)
    cases = ranks[0]
    assert len(cases) >= 18  # most seeds make a model that one process can train and that has enough layers
    assert {c["checkpoint"] for c in cases} == {"always", "except_last", "never"}
    assert any(c["batch"] < c["chunks"] for c in cases)  # some batches are smaller than `chunks`
    for rank in ranks:
        assert [c["seed"] for c in rank] == [c["seed"] for c in cases]
        for c in rank:
            assert c["loss"] <= 1e-6 and c["weights"] <= 1e-6, c


@pytest.fixture(scope="module")
def lightning_runs():
    """(one device, {K: [rank 0, ...]}) for the same random seeds: three spawns in all."""
    (reference,) = run_ok(RL.one_device, 1, LIGHTNING_SEEDS, timeout=600)
    return reference, {stages: run_ok(RL.pipelined, stages, LIGHTNING_SEEDS, timeout=600) for stages in (2, 3)}


@pytest.mark.parametrize("stages", [2, 3])
def test_random_lightning_runs_with_random_trainer_and_pipeline_settings_end_as_on_one_device(stages, lightning_runs):
    reference, pipelined = lightning_runs
    ranks = pipelined[stages]
    assert len(ranks[0]) >= 12
    drawn = [RL.settings(seed) | ranks[0][seed]["pipeline"] for seed in ranks[0]]
    for setting, values in [("manual", {True, False}), ("optimizer", {"sgd", "adam", "adamw"})]:
        assert {d[setting] for d in drawn} == values, setting  # the draws reach each kind
    assert {d["balance"] is None or isinstance(d["balance"], str) for d in drawn} == {True, False}
    for rank in ranks:
        for seed, got in rank.items():
            want = reference[seed]
            assert got["steps"] == want["steps"] and list(got["weights"]) == list(want["weights"]), seed
            for key, value in want["weights"].items():
                assert (got["weights"][key] - value).abs().max() <= 1e-6, (seed, key, got["pipeline"])
