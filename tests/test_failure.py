"""A rank that fails ends every rank of the job, quickly and with an error that names the failed stage."""

from __future__ import annotations

import _sweeps
import pytest

from lightning_gpipe.launch import run_processes


@pytest.mark.parametrize("stages, failing", [(2, 1), (3, 0), (3, 1), (3, 2)])
def test_an_exception_in_one_stage_ends_every_rank_within_seconds(stages, failing):
    outcome = run_processes(_sweeps.failing_fit, stages, failing, timeout=120)
    assert all(code is not None for code in outcome.exitcodes), f"hung ranks: {outcome.exitcodes}"
    assert all(code != 0 for code in outcome.exitcodes), outcome.exitcodes
    assert outcome.seconds < 60  # process start-up included; the failure itself propagates in about a second
    assert f"boom on rank {failing}" in outcome.errors[failing]
    for rank in range(stages):
        if rank != failing:
            assert outcome.errors[rank].startswith("PipelineError"), outcome.errors[rank]
            assert (
                f"stage {failing} (rank {failing}) failed: RuntimeError: boom on rank {failing}" in outcome.errors[rank]
            )
