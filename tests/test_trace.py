"""The timeline files: Chrome trace JSON that Perfetto and chrome://tracing read, and the PNG."""

from __future__ import annotations

import json

from lightning_gpipe.monitor.timeline import chrome_trace, write_chrome_trace, write_timeline_png
from lightning_gpipe.monitor.timer import Span, StepRecord


def _rows():
    """Two stages, two micro-batches, a diagonal; stage 1 waits (not drawn)."""
    stage0 = [
        Span("forward", 0, 10.0, 10.1),
        Span("forward", 1, 10.1, 10.2),
        Span("wait", -1, 10.2, 10.5),
        Span("backward", 1, 10.6, 10.7),
        Span("backward", 0, 10.7, 10.8),
    ]
    stage1 = [
        Span("forward", 0, 10.15, 10.25),
        Span("forward", 1, 10.25, 10.35),
        Span("recompute", 1, 10.4, 10.45),
        Span("backward", 1, 10.45, 10.55),
        Span("backward", 0, 10.55, 10.6),
    ]
    return {(0, 0): [StepRecord(3, 10.0, 11.0, stage0)], (0, 1): [StepRecord(3, 10.0, 11.0, stage1)]}


def test_chrome_trace_has_one_row_per_stage_and_one_complete_event_per_pass():
    trace = chrome_trace(_rows(), {"chunks": 2})
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["tid"], e["name"], e["cat"]) for e in boxes] == [
        (0, "F0", "forward"),
        (0, "F1", "forward"),
        (1, "F0", "forward"),
        (1, "F1", "forward"),
        (1, "R1", "recompute"),
        (1, "B1", "backward"),
        (1, "B0", "backward"),
        (0, "B1", "backward"),
        (0, "B0", "backward"),
    ]
    assert boxes[0]["ts"] == 0 and abs(boxes[2]["ts"] - 150000) < 1e-3 and abs(boxes[2]["dur"] - 100000) < 1e-3
    assert all(e["args"]["step"] == 3 for e in boxes)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0: "stage 0", 1: "stage 1"}
    assert trace["otherData"]["chunks"] == 2 and trace["displayTimeUnit"] == "ms"


def test_replicas_become_processes_of_the_trace():
    rows = {(r, s): records for r in (0, 1) for (_, s), records in _rows().items()}
    names = {e["pid"]: e["args"]["name"] for e in chrome_trace(rows)["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "pipeline (replica 0)", 1: "pipeline (replica 1)"}


def test_trace_and_png_files(tmp_path):
    path = write_chrome_trace(str(tmp_path / "sub" / "trace.json"), _rows())
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(chrome_trace(_rows())))
    png = write_timeline_png(str(tmp_path / "trace.png"), _rows(), "two stages")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
