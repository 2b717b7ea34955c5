"""Random Sequentials (tuples, views, in-place and frozen layers) train in a pipeline as in one process."""

from __future__ import annotations

import _random_models as R
import pytest

from lightning_gpipe.launch import run_ok

SEEDS = list(range(24))


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
