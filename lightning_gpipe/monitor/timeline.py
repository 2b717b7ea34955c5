"""Timeline of pipeline steps: a Chrome trace (Perfetto, chrome://tracing) and a PNG; plain PyTorch.

One row per stage and one box per (micro-batch, pass), so GPipe's fill-drain diagonal is what
you see: forward boxes step down the stages, backward boxes step back up, and the empty corners
are the bubble.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_gpipe.monitor.timer import COMPUTE, StepRecord

__all__ = ["chrome_trace", "write_chrome_trace", "write_timeline_png"]

#: Rows are keyed by ``(replica, stage)``: one pipeline per replica of data parallelism.
Rows = Mapping[tuple[int, int], Sequence[StepRecord]]

_LETTER = {"forward": "F", "recompute": "R", "backward": "B"}
_CNAME = {"forward": "thread_state_running", "recompute": "thread_state_runnable", "backward": "thread_state_iowait"}
_COLOR = {"forward": "#4c9a2a", "recompute": "#5b8bd0", "backward": "#e08a2c"}


def _boxes(rows: Rows) -> list[tuple[int, int, int, str, int, float, float]]:
    """(replica, stage, step, kind, micro, start, end) of every compute pass, in time order."""
    boxes = [
        (replica, stage, record.step, s.kind, s.micro, s.start, s.end)
        for (replica, stage), records in rows.items()
        for record in records
        for s in record.spans
        if s.kind in COMPUTE
    ]
    return sorted(boxes, key=lambda b: b[5])


def chrome_trace(rows: Rows, metadata: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The Trace Event Format (JSON object form) of the steps in ``rows``.

    Each replica is a process, each stage a thread (a row), each pass a complete ("X") event named
    ``F3``, ``R3`` or ``B3`` for micro-batch 3, with ``cat`` the pass and ``args`` its step and
    micro-batch. Times are microseconds from the first box; ``metadata`` goes to ``otherData``.

    >>> from lightning_gpipe.monitor.timer import Span
    >>> rows = {(0, 0): [StepRecord(0, 0.0, 1.0, [Span("forward", 0, 0.25, 0.5)])]}
    >>> [(e["name"], e["ts"], e["dur"]) for e in chrome_trace(rows)["traceEvents"] if e["ph"] == "X"]
    [('F0', 0.0, 250000.0)]
    """
    boxes = _boxes(rows)
    origin = boxes[0][5] if boxes else 0.0
    replicas = sorted({r for r, _ in rows})
    events: list[dict[str, Any]] = []
    for replica in replicas:
        name = "pipeline" if len(replicas) == 1 else f"pipeline (replica {replica})"
        events.append({"ph": "M", "name": "process_name", "pid": replica, "tid": 0, "args": {"name": name}})
    for replica, stage in sorted(rows):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": replica, "tid": stage, "args": {"name": f"stage {stage}"}}
        )
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": replica, "tid": stage, "args": {"sort_index": stage}}
        )
    for replica, stage, step, kind, micro, start, end in boxes:
        events.append(
            {
                "ph": "X",
                "name": f"{_LETTER[kind]}{micro}",
                "cat": kind,
                "pid": replica,
                "tid": stage,
                "ts": (start - origin) * 1e6,
                "dur": (end - start) * 1e6,
                "cname": _CNAME[kind],
                "args": {"step": step, "micro_batch": micro, "stage": stage},
            }
        )
    other = {"clock": "time.time() of the host, microseconds from the first box", **(metadata or {})}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(path: str, rows: Rows, metadata: Optional[Mapping[str, Any]] = None) -> str:
    """Write :func:`chrome_trace` to ``path`` (open it in https://ui.perfetto.dev or chrome://tracing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(rows, metadata), f)
    return path


def write_timeline_png(path: str, rows: Rows, title: str = "") -> Optional[str]:
    """Draw the same boxes as a PNG with matplotlib; returns ``None`` (and writes nothing) without it."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
        from matplotlib.patches import Patch
    except ImportError:
        return None
    boxes = _boxes(rows)
    keys = sorted(rows)
    level = {key: i for i, key in enumerate(keys)}
    origin = boxes[0][5] if boxes else 0.0
    fig = Figure(figsize=(11, 0.6 * len(keys) + 1.6))
    ax = fig.subplots()
    extent = max((b[6] - origin for b in boxes), default=0.0) * 1e3
    for replica, stage, _, kind, micro, start, end in boxes:
        y = level[(replica, stage)]
        left, width = (start - origin) * 1e3, (end - start) * 1e3
        ax.broken_barh([(left, width)], (y - 0.4, 0.8), facecolors=_COLOR[kind], edgecolors="white", linewidth=0.5)
        if width > 0.02 * extent:  # the micro-batch number, where the box is wide enough to hold it
            ax.text(left + width / 2, y, str(micro), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(keys)))
    names = [f"stage {s}" if len({r for r, _ in keys}) == 1 else f"replica {r} stage {s}" for r, s in keys]
    ax.set_yticklabels(names)
    ax.invert_yaxis()  # stage 0 on top, as in the GPipe paper's diagram
    ax.set_xlabel("ms")
    ax.set_title(title or "pipeline timeline")
    ax.legend(handles=[Patch(color=_COLOR[k], label=k) for k in COMPUTE], loc="upper right", fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
