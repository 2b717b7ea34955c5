"""PipelineMonitor over real 2- and 3-process pipelines: the trace, the ordering of boxes, the logged metrics."""

from __future__ import annotations

from collections import Counter

import _models as M
import lightning as L
import pytest
from _monitor_workers import monitored_fit

from lightning_gpipe import PipelineMonitor
from lightning_gpipe.engine.schedule import bubble_fraction
from lightning_gpipe.launch import run_ok

#: K -> (chunks, checkpoint mode, traced steps); the fits run 6 training batches, so batch 99 never runs
SETUPS = {2: (4, "except_last", [1, 3]), 3: (3, "always", [2, 99])}
FIT_BATCHES = 6


def _traced(stages):
    """The traced steps that ran."""
    return [step for step in SETUPS[stages][2] if step < FIT_BATCHES]


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    cache = {}

    def get(stages):
        if stages not in cache:
            chunks, checkpoint, steps = SETUPS[stages]
            directory = str(tmp_path_factory.mktemp(f"monitor{stages}"))
            cache[stages] = run_ok(monitored_fit, stages, directory, chunks, checkpoint, steps, timeout=300)
        return cache[stages]

    return get


def _boxes(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@pytest.mark.parametrize("stages", [2, 3])
def test_trace_holds_one_box_per_stage_micro_batch_and_pass(monitored, stages):
    chunks, checkpoint, _ = SETUPS[stages]
    steps = _traced(stages)
    trace = monitored(stages)[0]["trace"]
    counts = Counter((e["args"]["step"], e["cat"]) for e in _boxes(trace))
    recomputed = chunks if checkpoint == "always" else chunks - 1
    expected = {}
    for step in steps:
        expected.update(
            {
                (step, "forward"): stages * chunks,
                (step, "backward"): stages * chunks,
                (step, "recompute"): stages * recomputed,
            }
        )
    assert counts == expected
    cells = Counter((e["args"]["step"], e["cat"], e["tid"], e["args"]["micro_batch"]) for e in _boxes(trace))
    assert set(cells.values()) == {1}  # exactly one box per (step, pass, stage, micro-batch)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {k: f"stage {k}" for k in range(stages)}  # one row per stage


@pytest.mark.parametrize("stages", [2, 3])
def test_boxes_follow_the_fill_drain_order_across_processes(monitored, stages):
    boxes = {
        (e["args"]["step"], e["cat"], e["tid"], e["args"]["micro_batch"]): (e["ts"], e["ts"] + e["dur"])
        for e in _boxes(monitored(stages)[0]["trace"])
    }
    checked = 0
    for (step, kind, stage, micro), (start, _) in boxes.items():
        previous = {"forward": stage - 1, "backward": stage + 1}.get(kind)  # recompute carries no dependency
        if previous is None or not 0 <= previous < stages:
            continue
        assert start >= boxes[(step, kind, previous, micro)][1], (step, kind, stage, micro)
        checked += 1
    assert checked == 2 * (stages - 1) * SETUPS[stages][0] * len(_traced(stages))


@pytest.mark.parametrize("stages", [2, 3])
def test_a_trace_step_the_fit_never_reached_is_warned_about_on_rank_0(monitored, stages):
    # before: PipelineMonitor(trace_steps=[100]) on a 4-batch fit wrote no trace and said nothing
    warned = [r["warned"] for r in monitored(stages)]
    if stages == 2:  # every traced step ran
        assert warned == [[], []]
        return
    assert warned[1:] == [[], []]
    assert warned[0] == [
        "PipelineMonitor(trace_steps=[2, 99]): the fit ran 6 training batches (0 to 5), so batch [99] never ran and "
        "the trace holds the others. Give trace_steps below the number of training batches of the fit."
    ]


@pytest.mark.parametrize("stages", [2, 3])
def test_logged_per_stage_metrics_reach_the_csv_logger(monitored, stages):
    chunks = SETUPS[stages][0]
    rows = monitored(stages)[0]["csv"]
    logged = [r for r in rows if r.get("pipeline/bubble")]
    assert len(logged) == 3  # log_every_n_steps=2 over 6 steps
    for row in logged:
        for stage in range(stages):
            utilization = float(row[f"pipeline/stage{stage}/utilization"])
            assert 0 < utilization <= 1
            for name in ("forward_ms", "backward_ms", "wait_ms", "idle_ms", "step_ms", "peak_memory_mb"):
                assert float(row[f"pipeline/stage{stage}/{name}"]) >= 0
            assert float(row[f"pipeline/stage{stage}/forward_ms"]) > 0
            assert 0 <= float(row[f"pipeline/stage{stage}/bubble"]) < 1
        assert float(row["pipeline/bubble_theory"]) == pytest.approx(bubble_fraction(chunks, stages))
        assert 0 <= float(row["pipeline/bubble"]) < 1


@pytest.mark.parametrize("stages", [2, 3])
def test_every_stages_bubble_counts_over_the_first_stages_window_and_utilization_over_the_longest_step(
    monitored, stages
):
    summary = monitored(stages)[0]["summary"]
    busy = {s: v["forward"] + v["recompute"] + v["backward"] for s, v in summary.items()}
    window = busy[0] / (1 - summary[0]["bubble"])  # the pipeline's window: the first stage's fill and drain
    step = max(v["step"] for v in summary.values())  # the pipeline's step: its longest stage's
    for stage, values in summary.items():
        assert values["bubble"] == pytest.approx(1 - busy[stage] / window, abs=1e-9)
        assert values["utilization"] == pytest.approx(busy[stage] / step, abs=1e-9)
    table = monitored(stages)[0]["table"]
    measured = float(table.splitlines()[-1].split("measured ")[1].split(",")[0])
    assert measured == pytest.approx(sum(v["bubble"] for v in summary.values()) / stages, abs=1e-3)


@pytest.mark.parametrize("stages", [2, 3])
def test_the_progress_bar_shows_the_bubble_and_rank_0_logged_every_stage(monitored, stages):
    results = monitored(stages)
    for result in results:
        assert 0 <= result["progress_bar"]["pipeline/bubble"] < 1
    logged = results[0]["logged_metrics"]
    assert logged["pipeline/bubble"] == pytest.approx(results[0]["progress_bar"]["pipeline/bubble"], rel=1e-6)
    for stage in range(stages):
        assert 0 < logged[f"pipeline/stage{stage}/utilization"] <= 1


def test_rank_0_prints_a_per_stage_table_and_writes_a_png(monitored):
    result = monitored(3)[0]
    lines = result["table"].splitlines()
    assert lines[0].startswith("PipelineMonitor: 3 stages x 3 micro-batches")
    assert [line.split("|")[1].strip() for line in lines[3:6]] == ["0", "1", "2"]
    assert lines[-1].startswith("bubble: measured") and f"{bubble_fraction(3, 3):.3f}" in lines[-1]
    for values in result["summary"].values():
        assert 0 < values["utilization"] <= 1
        total = values["forward"] + values["recompute"] + values["backward"] + values["wait"] + values["idle"]
        assert total == pytest.approx(values["step"], rel=1e-6)
    assert result["png"] > 1000


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [-1, [-1], ["1"], 2])
def test_trace_steps_must_be_a_list_of_non_negative_indices(steps):
    with pytest.raises(ValueError, match="`trace_steps` must be a list of training-batch indices >= 0"):
        PipelineMonitor(trace_steps=steps)


def test_monitor_needs_the_gpipe_strategy():
    trainer = L.Trainer(callbacks=[PipelineMonitor()], devices=1, **M.trainer_kwargs(max_steps=1))
    with pytest.raises(ValueError, match=r"measures a gpipe pipeline.*SingleDeviceStrategy.*strategy='gpipe'"):
        trainer.fit(M.Net(), M.loader())
