"""balance="time" and "memory" in the strategy: one measurement, broadcast, logged; same training as one device."""

from __future__ import annotations

import contextlib
import logging
import re

import _models as M
import _sweeps
import lightning as L
import pytest
import torch
import torch.nn.functional as F
from test_fidelity import assert_same_training

from lightning_gpipe import GPipeStrategy, balance
from lightning_gpipe.balancing.plan.search import searched_split
from lightning_gpipe.engine.partition import balance_by_params


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", ["balance=time", "balance=memory"])
def test_time_and_memory_balanced_pipelines_match_one_device(stages, name, pipeline_runs, reference_run):
    config = next(c for c in _sweeps.EXTRAS if c.name == name)
    assert_same_training(pipeline_runs(stages), name, reference_run(config), atol=1e-6)


def test_rank_0_measures_once_and_every_rank_builds_that_split(pipeline_runs):
    first, second = (r["measured balance"] for r in pipeline_runs(2))
    for kind in ("time", "memory"):
        assert first[kind]["balance"] == second[kind]["balance"]
        # bit-identical times: measured once and broadcast (two measurements would never agree exactly)
        assert first[kind]["costs"] == second[kind]["costs"]
        assert first[kind]["balance"] == balance(first[kind]["costs"].of(kind), 2)
        assert len(first[kind]["costs"].time) == 7 and all(t > 0 for t in first[kind]["costs"].time)


def test_the_chosen_split_is_logged_on_rank_0_as_a_table(pipeline_runs):
    first, second = (r["measured balance"] for r in pipeline_runs(2))
    log = "\n".join(first["time"]["log"])
    assert (
        "Profiled `backbone` layer by layer on cpu with a micro-batch of 4 samples from the first batch of "
        "the train dataloader"
    ) in log
    assert (
        "GPipe split of `backbone` into 2 stages by balance='time':\n| stage | layers | params | time | memory |" in log
    )
    rows = re.findall(r"^\| (\d) \| (\d+)(?:-(\d+))? \| ([\d,]+) \| ([\d.]+)% \| ([\d.]+)% \|$", log, re.MULTILINE)
    assert [int(r[0]) for r in rows] == [0, 1]
    sizes = [int(r[2] or r[1]) - int(r[1]) + 1 for r in rows]
    assert sizes == first["time"]["balance"]
    assert sum(int(r[3].replace(",", "")) for r in rows) == sum(p.numel() for p in M.mlp().parameters())
    assert sum(float(r[4]) for r in rows) == pytest.approx(100, abs=0.2)
    assert sum(float(r[5]) for r in rows) == pytest.approx(100, abs=0.2)
    assert not any("GPipe split" in m or "Profiled" in m for m in second["time"]["log"])


def test_the_default_balance_splits_by_measured_time_and_says_so(pipeline_runs):
    first, second = (r["measured balance"]["default"] for r in pipeline_runs(2))
    # the split by time, or one near it that the replay of a step predicts 2% faster or more (the same costs)
    assert first["balance"] == second["balance"] == searched_split(first["costs"], 2, 2, "except_last")[0]
    assert first["costs"].time == second["costs"].time  # measured once, on rank 0, and broadcast
    log = "\n".join(first["log"])
    assert "GPipe split of `backbone` into 2 stages by the default balance (time):" in log
    assert not any("GPipe split" in m for m in second["log"])


def test_the_default_balance_takes_the_faster_split_the_replay_finds_where_the_phases_weigh_apart(pipeline_runs):
    first, second = (r["measured balance"]["phases apart"] for r in pipeline_runs(2))
    by_time = balance(first["costs"].time, 2)
    assert by_time == [4, 4]  # 5 ms in each sleeping layer's forward or backward: the same forward plus backward
    searched, said = searched_split(first["costs"], 2, 2, "never")
    assert first["balance"] == second["balance"] == searched != by_time
    assert said is not None and said in first["log"] and not any("replay of a step" in m for m in second["log"])


def test_the_default_balance_without_a_sample_splits_by_params_and_warns_on_rank_0(pipeline_runs):
    first, second = (r["measured balance"]["default, no sample"] for r in pipeline_runs(2))
    assert first["balance"] == second["balance"] == balance_by_params(M.Net().backbone, 2)
    assert first["costs"] is None
    warned = [w for w in first["warnings"] if "The default balance (by measured time) splits by parameter count" in w]
    assert len(warned) == 1 and "needs a sample micro-batch, but none could be taken" in warned[0]
    assert not any("The default balance" in w for w in second["warnings"])
    assert "GPipe split of `backbone` into 2 stages by the default balance (params):" in "\n".join(first["log"])


def test_the_default_balance_measures_nothing_for_one_stage(caplog):
    strategy = GPipeStrategy()
    trainer = L.Trainer(strategy=strategy, devices=1, **M.trainer_kwargs(max_steps=1))
    with lightning_log(caplog):
        trainer.fit(M.Net(), M.loader())
    assert "into 1 stage by the default balance (one stage: nothing to measure):" in caplog.text
    assert strategy.layer_costs is None and "Profiled" not in caplog.text


def test_a_layer_that_fails_during_profiling_is_named_on_every_rank(pipeline_runs):
    for rank_results in pipeline_runs(2):
        message = rank_results["measured balance"]["failing layer"]
        assert message.startswith("RuntimeError: Profiling layer 3 (Broken) of the backbone on a micro-batch of "), (
            message
        )
        assert "failed with RuntimeError: this layer is broken" in message


@contextlib.contextmanager
def lightning_log(caplog):
    """Collect Lightning's INFO messages (its logger does not propagate to the root logger that caplog watches)."""
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            yield
    finally:
        logger.removeHandler(caplog.handler)


class Manual(M.Net):
    """Manual optimization: its training_step needs the optimizer, which does not exist when the split is chosen."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_no_sample_for_balance_time_is_a_clear_error():
    trainer = L.Trainer(strategy=GPipeStrategy(balance="time"), devices=1, **M.trainer_kwargs(max_steps=1))
    with pytest.raises(
        ValueError,
        match=r"needs a sample micro-batch, but none could be taken: `training_step` on the "
        r"first batch of the train dataloader did not call `self.backbone` "
        r"\(AttributeError: .*\); `Manual.example_input_array` is not set\. Set "
        r"`self.example_input_array`.*or use balance='params'",
    ):
        trainer.fit(Manual(), M.loader())


def test_example_input_array_is_the_sample_when_the_step_cannot_give_one(caplog):
    model = Manual()
    model.example_input_array = torch.randn(8, M.FEATURES)
    strategy = GPipeStrategy(balance="memory")
    trainer = L.Trainer(strategy=strategy, devices=1, **M.trainer_kwargs(max_steps=1))
    with lightning_log(caplog):
        trainer.fit(model, M.loader())
    assert "with a micro-batch of 2 samples from `example_input_array`" in caplog.text
    assert strategy.layer_costs is not None
    assert strategy.layer_costs.activation_bytes[0] == 2 * M.FEATURES * 4  # the first Linear saves its input


def test_balance_params_logs_the_split_without_measuring(caplog):
    trainer = L.Trainer(strategy=GPipeStrategy(balance="params"), devices=1, **M.trainer_kwargs(max_steps=1))
    with lightning_log(caplog):
        trainer.fit(M.Net(), M.loader())
    assert "into 1 stage by balance='params':" in caplog.text
    assert "| 0 | 0-6 | 924 | n/a | n/a |" in caplog.text
    assert trainer.strategy.layer_costs is None


def test_predict_profiles_on_the_predict_dataloader_through_predict_step(caplog):
    model = M.Net()
    strategy = GPipeStrategy(balance="time", chunks=2)
    trainer = L.Trainer(strategy=strategy, devices=1, **M.trainer_kwargs())
    with lightning_log(caplog):
        predictions = trainer.predict(model, M.loader(batch_size=10, shuffle=False))
    assert "a micro-batch of 5 samples from the first batch of the predict dataloader" in caplog.text
    assert len(strategy.layer_costs.time) == 7
    with torch.no_grad():
        expected = torch.cat([model(x) for x, _ in M.loader(batch_size=10, shuffle=False)])
    torch.testing.assert_close(torch.cat(predictions), expected, atol=1e-6, rtol=0)
