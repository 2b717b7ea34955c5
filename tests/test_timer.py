"""The engine's tracer hook and StageTimer: which passes are reported, totals, and the CUDA-event path."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from lightning_gpipe import GPipe, StageTimer
from lightning_gpipe.engine.tracer import span
from lightning_gpipe.monitor.timer import Span, StepRecord, derived, peak_memory_bytes, wall_clock_offset


class Recorder:
    """A tracer that keeps what the engine reports."""

    def __init__(self):
        self.calls = []

    def start(self, kind):
        return time.perf_counter()

    def stop(self, kind, micro, token):
        self.calls.append((kind, micro))


@pytest.mark.parametrize(
    "checkpoint, recomputed", [("always", [3, 2, 1, 0]), ("except_last", [2, 1, 0]), ("never", [])]
)
def test_engine_reports_every_pass_of_a_training_step(checkpoint, recomputed):
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), chunks=4, checkpoint=checkpoint)
    pipe.tracer = recorder = Recorder()
    pipe(torch.randn(8, 4)).sum().backward()
    calls = recorder.calls
    assert [m for k, m in calls if k == "forward"] == [0, 1, 2, 3]
    assert [m for k, m in calls if k == "backward"] == [3, 2, 1, 0]
    assert [m for k, m in calls if k == "recompute"] == recomputed
    assert calls[-1] == ("drain", -1) and ("fill", -1) in calls  # the windows close after their passes
    fill_end = calls.index(("fill", -1))
    assert {k for k, _ in calls[:fill_end]} == {"forward"}  # one process: nothing to wait for


def test_no_tracer_means_no_calls_and_the_same_results():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4)), chunks=2)
    untraced = pipe(x)
    pipe.tracer = StageTimer(torch.device("cpu"))  # installed but no step open: passes are ignored
    assert torch.equal(pipe(x), untraced)
    assert pipe.tracer.collect() == []
    assert pipe.runner.tracer is pipe.tracer  # the public accessor sets the engine's hook
    pipe.tracer = None
    assert pipe.runner.tracer is None


def test_timer_records_only_inside_steps_and_totals_add_up():
    timer = StageTimer(torch.device("cpu"), offset=100.0)
    with span(timer, "forward", 0):
        pass  # before any step: ignored
    timer.begin_step(7)
    with span(timer, "fill"):
        with span(timer, "forward", 0):
            time.sleep(0.002)
        with span(timer, "wait", -1):
            time.sleep(0.002)
    with span(timer, "drain"):
        with span(timer, "backward", 0):
            time.sleep(0.002)
    timer.end_step()
    [record] = timer.collect()
    assert timer.collect() == []  # collected once
    assert record.step == 7 and [s.kind for s in record.spans] == ["forward", "wait", "fill", "backward", "drain"]
    assert all(record.start <= s.start <= s.end <= record.end for s in record.spans)
    assert record.start > 100.0  # the offset moves stamps to the shared clock
    totals = record.totals()
    assert totals["forward"] >= 0.002 and totals["wait"] >= 0.002 and totals["backward"] >= 0.002
    assert totals["window"] >= totals["forward"] + totals["wait"] + totals["backward"]
    extra = derived(totals)
    assert 0 < extra["utilization"] <= 1
    assert extra["idle"] == pytest.approx(totals["step"] - totals["forward"] - totals["backward"] - totals["wait"])


def test_derived_metrics_of_a_known_step():
    record = StepRecord(
        0,
        0.0,
        10.0,
        [
            Span("fill", -1, 0.0, 4.0),
            Span("forward", 0, 1.0, 2.0),
            Span("wait", 0, 2.0, 3.0),
            Span("drain", -1, 5.0, 9.0),
            Span("recompute", 0, 5.0, 6.0),
            Span("backward", 0, 6.0, 8.0),
        ],
    )
    assert derived(record.totals()) == {"idle": 5.0, "utilization": 0.4, "bubble": 0.5}
    assert math.isnan(derived(StepRecord(0, 0.0, 0.0, []).totals())["utilization"])


def test_the_bubble_of_a_later_stage_counts_over_the_pipelines_window_not_its_own():
    # K=2, M=1, equal stages of one unit per pass: the first stage's fill and drain span 4 units, the last stage's
    # only 3 (its fill starts when the first forward has arrived). GPipe's bubble is (K-1)/(M+K-1) = 0.5 for both.
    last = StepRecord(
        0,
        1.0,
        4.0,
        [
            Span("fill", -1, 1.0, 2.0),
            Span("forward", 0, 1.0, 2.0),
            Span("drain", -1, 2.0, 3.0),
            Span("backward", 0, 2.0, 3.0),
        ],
    )
    assert derived(last.totals())["bubble"] == 0.0  # over its own window: no bubble seen
    assert derived(last.totals(), window=4.0)["bubble"] == 0.5  # over the first stage's: the theory


def test_wall_clock_offset_places_perf_counter_on_the_hosts_clock():
    offset = wall_clock_offset()
    assert abs(time.perf_counter() + offset - time.time()) < 0.01


def test_peak_memory_on_the_cpu_is_the_process_high_water_mark():
    before = peak_memory_bytes(torch.device("cpu"))
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert peak_memory_bytes(torch.device("cpu")) >= before
    assert peak_memory_bytes(torch.device("cpu")) >= block.numel() * 4
    del block


class FakeEvent:
    """Stands in for torch.cuda.Event on a machine without a GPU: completes when the test says so."""

    clock = 0.0
    done = False

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self):
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def query(self):
        return FakeEvent.done

    def synchronize(self):
        FakeEvent.done = True

    def elapsed_time(self, end):
        assert FakeEvent.done, "reading an event before it completed would stall or fail"
        return (end.at - self.at) * 1e3  # ms


def test_cuda_events_are_read_only_once_complete_and_waits_stay_on_the_host(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.clock, FakeEvent.done = 0.0, False
    timer = StageTimer(torch.device("cuda", 0), offset=0.0)
    timer.begin_step(0)
    with span(timer, "forward", 0):
        pass
    with span(timer, "wait", 0):
        pass
    timer.end_step()
    assert timer.collect() == []  # the device has not finished the step: nothing is read, nothing blocks
    FakeEvent.done = True
    [record] = timer.collect()
    forward, wait = record.spans
    assert (forward.end - forward.start, record.end - record.start) == (1.0, 3.0)  # device time, in seconds
    assert wait.end - wait.start < 0.01  # a host stamp
    FakeEvent.done = False
    timer.begin_step(1)
    timer.end_step()
    assert [r.step for r in timer.collect(wait=True)] == [1]  # at the end of a run: synchronize and read
