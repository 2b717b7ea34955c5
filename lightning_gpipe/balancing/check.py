"""Is the profiled split right? The stages' compute measured in real training steps, against the profile's prediction.

``balance="time"`` splits by a profile taken once, layer by layer, on rank 0. On a shared machine that
profile can be wrong: another process was busy, a layer costs more on the real batch or after warm-up.
The pipeline then runs at the pace of a stage the profile thought was light. So a few training steps
are timed per stage (:class:`ComputeTally`, a tracer) and compared with what the profile predicted for
the same split (:func:`compare`); :class:`BalanceCheck` says whether the profile was wrong, and which
split the measured times suggest. Pure apart from the clock; the strategy does the collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from lightning_gpipe.engine.partition import balance as optimal_balance
from lightning_gpipe.engine.tracer import Tracer

__all__ = ["TOLERANCE", "BalanceCheck", "ComputeTally", "compare"]

#: How much worse than predicted the measured imbalance (slowest stage over the mean) may be before the
#: profile counts as wrong. Stage times of one run on a shared 2-core CPU spread by up to about 10% from
#: step to step, so a smaller margin would cry wolf.
TOLERANCE = 0.15

_COMPUTE = ("forward", "recompute", "backward")


class ComputeTally:
    """A tracer that adds up this stage's training compute (forward, recompute, backward) and passes every
    report on to the tracer it wraps (a user's ``PipelineMonitor``), so both see the same passes.

    While ``paused`` (the strategy pauses it for validation loops) nothing is counted: the check compares
    training steps. On a GPU the passes are timed with CUDA events, read only in :meth:`seconds`, so
    timing adds no synchronization.
    """

    def __init__(self, device: torch.device, inner: Optional[Tracer] = None) -> None:
        self.device, self.inner = device, inner
        self.paused = False
        self._cpu = 0.0
        self._events: list[tuple[Any, Any]] = []

    def start(self, kind: str) -> Any:
        token = self.inner.start(kind) if self.inner is not None else None
        if kind not in _COMPUTE or self.paused:
            return (token, None)
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return (token, event)
        return (token, time.perf_counter())

    def stop(self, kind: str, micro: int, token: Any) -> None:
        inner_token, began = token
        if began is not None:
            if self.device.type == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append((began, end))
            else:
                self._cpu += time.perf_counter() - began
        if self.inner is not None:
            self.inner.stop(kind, micro, inner_token)

    def seconds(self) -> float:
        """The compute counted so far, in seconds."""
        if self._events:
            torch.cuda.synchronize(self.device)
        return self._cpu + sum(a.elapsed_time(b) for a, b in self._events) / 1e3


@dataclass(frozen=True)
class BalanceCheck:
    """The profile's prediction for a split beside the stages' measured compute, and the verdict."""

    balance: list[int]
    predicted: list[float]  # each stage's share of the profiled cost
    measured: list[float]  # each stage's share of the measured compute
    predicted_imbalance: float  # slowest stage over the mean, as predicted
    measured_imbalance: float  # the same, as measured
    wrong: bool  # measured imbalance beyond the prediction by more than the tolerance
    suggested: list[int]  # the split that the measured times suggest
    steps: int

    def table(self) -> str:
        """Stage, layers, predicted and measured share: a markdown table for the log."""
        rows = ["| stage | layers | predicted share | measured share |", "|---:|---|---:|---:|"]
        start = 0
        for stage, (count, p, m) in enumerate(zip(self.balance, self.predicted, self.measured)):
            rows.append(f"| {stage} | {start}-{start + count - 1} | {p:.1%} | {m:.1%} |")
            start += count
        return "\n".join(rows)

    def message(self) -> str:
        """What the log says: the verdict, the numbers and, when the profile was wrong, what to do."""
        numbers = (
            f"slowest stage over the mean: predicted {self.predicted_imbalance:.2f}, measured "
            f"{self.measured_imbalance:.2f} over {self.steps} training steps"
        )
        if not self.wrong:
            return f"GPipe balance check: the profiled split {self.balance} holds ({numbers})."
        slow = max(range(len(self.measured)), key=lambda s: self.measured[s] / max(self.predicted[s], 1e-12))
        return (
            f"GPipe balance check: the profile was wrong for split {self.balance}: stage {slow} computed "
            f"{self.measured[slow]:.1%} of the step's work against {self.predicted[slow]:.1%} predicted ({numbers}; "
            f"tolerance {TOLERANCE:.0%}).\n{self.table()}\nThe measured times suggest balance={self.suggested}: pass "
            "it to GPipeStrategy(balance=...), or profile again on a quiet machine. The results do not depend on "
            "the split; only the speed does."
        )


def _shares(values: Sequence[float]) -> list[float]:
    total = sum(values)
    return [v / total if total > 0 else 1.0 / len(values) for v in values]


def _imbalance(shares: Sequence[float]) -> float:
    return max(shares) * len(shares)  # max over the mean, since shares sum to 1


def compare(
    layer_costs: Sequence[float], balance: Sequence[int], measured: Sequence[float], steps: int = 1
) -> BalanceCheck:
    """The check of ``balance`` (layers per stage) split by ``layer_costs`` against ``measured`` seconds per stage.

    The suggested split scales each layer's profiled cost by how far its stage's measured share is from the
    predicted one, then balances those costs again: the best guess at the layers' true costs that the
    measurement allows (it sees stages, not layers).
    """
    if len(measured) != len(balance) or sum(balance) != len(layer_costs):
        raise ValueError(
            f"A balance check needs one measured time per stage of {list(balance)} and one cost per layer "
            f"({sum(balance)}); got {len(measured)} times and {len(layer_costs)} costs."
        )
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    predicted = _shares([sum(layer_costs[a:b]) for a, b in zip(bounds, bounds[1:])])
    shares = _shares(measured)
    scaled = [
        cost * (shares[s] / predicted[s] if predicted[s] > 0 else 1.0)
        for s, (a, b) in enumerate(zip(bounds, bounds[1:]))
        for cost in layer_costs[a:b]
    ]
    predicted_imbalance, measured_imbalance = _imbalance(predicted), _imbalance(shares)
    return BalanceCheck(
        balance=list(balance),
        predicted=predicted,
        measured=shares,
        predicted_imbalance=predicted_imbalance,
        measured_imbalance=measured_imbalance,
        wrong=measured_imbalance > predicted_imbalance * (1 + TOLERANCE),
        suggested=optimal_balance(scaled, len(balance)),
        steps=steps,
    )
