"""Per-stage timing of a pipeline: a timer that records steps on a shared clock.

The engine reports each pass of its stage through ``GPipe.tracer``
(:class:`lightning_gpipe.engine.tracer.Tracer`); :class:`StageTimer` implements it. On the CPU it
stamps ``time.perf_counter``; on a GPU it records CUDA events on the current stream and reads them
only once they have completed, so it adds no synchronization to the step. Times are then moved to
one clock that every process of a host shares (see :func:`wall_clock_offset`), so the boxes of
different stages can be compared.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import torch

try:
    import resource
except ImportError:  # Windows: no getrusage
    resource = None  # type: ignore[assignment]

__all__ = ["Span", "StepRecord", "StageTimer", "FIELDS", "COMPUTE", "wall_clock_offset", "derived", "peak_memory_bytes"]

#: The passes that are work: their time is the stage's busy time.
COMPUTE = ("forward", "recompute", "backward")
#: Seconds per step that :meth:`StepRecord.totals` adds up; ``window`` is the fill plus the drain.
FIELDS = ("forward", "recompute", "backward", "wait", "window", "step")


def wall_clock_offset(samples: int = 7) -> float:
    """Seconds to add to a ``time.perf_counter()`` stamp to place it on ``time.time()``'s clock.

    ``perf_counter`` has the resolution but its origin is per process; ``time.time`` is the host's one
    clock, which every process reads alike. The offset is sampled once (the tightest of a few
    readings), so later stamps keep ``perf_counter``'s resolution and monotonicity. Across hosts the
    clocks agree only as well as NTP keeps them.
    """
    best = (math.inf, 0.0)
    for _ in range(samples):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        best = min(best, (after - before, wall - (before + after) / 2))
    return best[1]


@dataclass(frozen=True)
class Span:
    """One pass of one stage, in seconds on the shared clock."""

    kind: str
    micro: int
    start: float
    end: float


@dataclass
class StepRecord:
    """What one stage did in one training step: its passes and the step's bounds."""

    step: int
    start: float
    end: float
    spans: list[Span]

    def totals(self) -> dict[str, float]:
        """Seconds per pass kind in this step (see :data:`FIELDS`)."""
        out = dict.fromkeys(FIELDS, 0.0)
        for s in self.spans:
            out["window" if s.kind in ("fill", "drain") else s.kind] += s.end - s.start
        out["step"] = self.end - self.start
        return out


def derived(totals: dict[str, float], window: Optional[float] = None, step: Optional[float] = None) -> dict[str, float]:
    """Idle seconds, utilization and measured bubble from (summed or averaged) :meth:`StepRecord.totals`.

    - utilization: busy (forward + recompute + backward) over the pipeline's ``step`` (by default this
      stage's own). A pipeline's stages share one step time, the longest stage's: Lightning 2.6 broadcasts a
      flag over every rank at the start of each training step, before ``on_train_batch_start``, so a later
      stage waits there for the first stage to end its drain, outside its own step (measured: 48 ms of a
      245 ms step at K=2, which made that stage look 20% busier than it was);
    - idle: this stage's step time neither busy nor waiting (the loss, the optimizer, the framework);
    - bubble: the share of the pipeline's ``window`` this stage was not busy, the measured counterpart of
      GPipe's ``(K - 1) / (M + K - 1)``; it also holds any imbalance between stages. The pipeline's window is
      the first stage's fill plus drain (give it as ``window``; by default this stage's own): the first stage
      starts the first forward and ends the last backward, so every other stage's passes lie inside it. A later
      stage's own fill and drain leave out the time before its first input and after its last gradient, which
      is bubble too (measured at K=2, M=1: 0.42 that way, against 0.50 over the first stage's window).
    """
    busy = sum(totals[k] for k in COMPUTE)
    own = totals["step"]
    step = own if step is None else step
    window = totals["window"] if window is None else window
    return {
        "idle": max(own - busy - totals["wait"], 0.0),
        "utilization": busy / step if step > 0 else math.nan,
        "bubble": max(1.0 - busy / window, 0.0) if window > 0 else math.nan,
    }


def peak_memory_bytes(device: torch.device) -> float:
    """The high-water mark of memory: CUDA's max-allocated on a GPU, the process's peak RSS on the CPU.

    The CPU figure is ``getrusage(RUSAGE_SELF).ru_maxrss`` (KiB on Linux, bytes on macOS), the
    standard library's peak resident set of this process since it started; it cannot be reset.
    """
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    if resource is None:
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


@dataclass
class _Open:
    step: int
    begin: Any
    end: Any
    raw: list[tuple[str, int, Any, Any]]
    host_begin: float


class StageTimer:
    """Times one stage's passes, step by step; install it as ``GPipe.tracer`` (it is a :class:`Tracer`).

    Call :meth:`begin_step` and :meth:`end_step` around each training step; passes outside a step
    (validation, say) are ignored. :meth:`collect` returns the steps whose times are known: at once
    on the CPU; on a GPU once the step's last event has completed, so reading it never stalls the
    device (``wait=True`` synchronizes, for the end of a run).

    >>> from lightning_gpipe.engine.tracer import span
    >>> timer = StageTimer(torch.device("cpu"))
    >>> timer.begin_step(0)
    >>> with span(timer, "forward", 0):
    ...     pass
    >>> timer.end_step()
    >>> [(s.kind, s.micro) for s in timer.collect()[0].spans]
    [('forward', 0)]
    """

    def __init__(self, device: torch.device, offset: Optional[float] = None) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.offset = wall_clock_offset() if offset is None else offset
        self._open: Optional[_Open] = None
        self._pending: deque[_Open] = deque()

    def _stamp(self, kind: str) -> Any:
        if self.cuda and kind != "wait":  # waits are the host's; everything else is the device's work
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, kind: str) -> Any:
        return None if self._open is None else self._stamp(kind)

    def stop(self, kind: str, micro: int, token: Any) -> None:
        if token is not None and self._open is not None:
            self._open.raw.append((kind, micro, token, self._stamp(kind)))

    def begin_step(self, step: int) -> None:
        """Start recording training step ``step``."""
        host = time.perf_counter()
        self._open = _Open(step, self._stamp("step"), None, [], host)

    def end_step(self) -> None:
        """Stop recording the current step; its times become available from :meth:`collect`."""
        if self._open is None:
            return
        self._open.end = self._stamp("step")
        self._pending.append(self._open)
        self._open = None

    def collect(self, wait: bool = False) -> list[StepRecord]:
        """The finished steps not collected before, oldest first."""
        done = []
        while self._pending:
            item = self._pending[0]
            if self.cuda:
                if not wait and not item.end.query():
                    break
                item.end.synchronize()
            done.append(self._resolve(self._pending.popleft()))
        return done

    def _resolve(self, item: _Open) -> StepRecord:
        if self.cuda:  # events count from the step's first event, which the host recorded at host_begin
            origin = item.host_begin + self.offset

            def at(token: Any) -> float:
                if isinstance(token, float):
                    return token + self.offset
                return origin + item.begin.elapsed_time(token) / 1e3
        else:

            def at(token: Any) -> float:
                return token + self.offset

        spans = [Span(kind, micro, at(a), at(b)) for kind, micro, a, b in item.raw]
        return StepRecord(item.step, at(item.begin), at(item.end), spans)
