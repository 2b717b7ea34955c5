"""``GPipeStrategy(chunks="auto", checkpoint="auto", balance="auto")``: one plan on every rank, logged, exact."""

from __future__ import annotations

import _models as M
import _plan_workers
import lightning as L
import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from test_fidelity import assert_same_training
from torch.utils.data import DataLoader

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.launch import run_ok


@pytest.fixture(scope="module")
def auto_runs(session_tmp):
    return run_ok(_plan_workers.auto_sweep, 2, timeout=300)


def test_every_rank_takes_rank_0s_choice_and_rank_0_logs_it_with_the_runner_up(auto_runs):
    chunks, checkpoint, balance = auto_runs[0]["choice"]
    assert all(rank["choice"] == (chunks, checkpoint, balance) for rank in auto_runs)
    assert 1 <= chunks <= 8 and len(balance) == 2 and sum(balance) == 7
    plan_log = [m for m in auto_runs[0]["log"] if m.startswith("GPipe plan for 2 stages")]
    assert len(plan_log) == 1 and "| choice |" in plan_log[0] and "| runner-up |" in plan_log[0]
    assert not [m for m in auto_runs[1]["log"] if m.startswith("GPipe plan")]


def test_the_automatic_choice_trains_as_one_device(auto_runs, reference_run):
    assert_same_training(auto_runs, "auto", reference_run(_plan_workers.REFERENCE), atol=1e-6)


def test_a_memory_cap_that_no_candidate_fits_is_refused_at_setup_on_every_rank(auto_runs):
    for rank in auto_runs:
        assert rank["capped"].startswith("ValueError: No (chunks, checkpoint, balance) is predicted to fit")
        assert "smallest predicted peak" in rank["capped"]


def test_auto_values_and_max_memory_are_checked_at_construction():
    with pytest.raises(ValueError, match="'params', 'time', 'memory' or 'auto'"):
        GPipeStrategy(balance="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_memory` must be a positive number"):
        GPipeStrategy(chunks="auto", max_memory=0)
    with pytest.raises(ValueError, match="'keep:N'"):
        GPipeStrategy(checkpoint="automatic")


class TrainOnly(L.LightningDataModule):
    """A datamodule without ``predict_dataloader``."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(M.dataset(16), batch_size=8)


@pytest.mark.parametrize("balance", ["auto", None], ids=["auto", "default balance"])
def test_predict_on_a_datamodule_without_a_predict_loader_gets_lightnings_error_not_a_missing_sample(balance):
    # an outside tester's `lightning-gpipe predict` on a shipped config: the profile failed first, with a NoSampleError
    # that advised `example_input_array`, and following it led to Lightning's error only after it
    strategy = GPipeStrategy(chunks="auto", balance=balance)
    trainer = L.Trainer(strategy=strategy, devices=1, **M.trainer_kwargs())
    with pytest.raises(MisconfigurationException, match="`predict_dataloader` must be implemented"):
        trainer.predict(M.Net(), datamodule=TrainOnly())
