"""Checkpointing by count (``checkpoint="keep:N"``): all but the last N recomputed; training matches one device."""

from __future__ import annotations

import _keep_workers
import pytest
from test_fidelity import assert_same_training

from lightning_gpipe.launch import run_ok


@pytest.fixture(scope="module")
def keep_runs(session_tmp):
    return run_ok(_keep_workers.keep_sweep, 2, timeout=300)


def test_keep_n_recomputes_exactly_the_micro_batches_before_the_last_n_on_every_stage(keep_runs):
    assert [rank["recomputed"] for rank in keep_runs] == [[1, 0], [1, 0]]  # the drain's order: 3, 2 kept


@pytest.mark.parametrize("config", _keep_workers.KEEP_CONFIGS, ids=lambda c: c.name)
def test_lightning_fits_with_keep_n_match_one_device(config, keep_runs, reference_run):
    assert_same_training(keep_runs, config.name, reference_run(config), atol=1e-6)
