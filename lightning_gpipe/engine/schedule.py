"""Which (micro-batch, stage, pass) runs when in a fill-drain (GPipe) schedule; pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_gpipe.engine.checkpoint import checkpointed

__all__ = ["Task", "bubble_fraction", "clock_cycles", "fill_drain"]

Pass = Literal["forward", "recompute", "backward"]


@dataclass(frozen=True)
class Task:
    """One unit of work of one stage: a pass over one micro-batch.

    >>> Task("forward", micro=0)
    Task(kind='forward', micro=0)
    """

    kind: Pass
    micro: int


def fill_drain(chunks: int, checkpoint: str = "except_last") -> tuple[list[Task], list[Task]]:
    """One stage's tasks for one step: the forward (fill) in micro-batch order, then the backward (drain).

    The drain runs micro-batches in reverse. A checkpointed micro-batch is recomputed right before its
    backward, which lets the recompute overlap the wait for the output gradient from the next stage.
    The order is the same on every stage; only the arrival of inputs staggers the stages.

    >>> fwd, bwd = fill_drain(2, "always")
    >>> [(t.kind, t.micro) for t in bwd]
    [('recompute', 1), ('backward', 1), ('recompute', 0), ('backward', 0)]
    """
    forward = [Task("forward", i) for i in range(chunks)]
    backward: list[Task] = []
    for i in reversed(range(chunks)):
        if checkpointed(checkpoint, i, chunks):
            backward.append(Task("recompute", i))
        backward.append(Task("backward", i))
    return forward, backward


def clock_cycles(chunks: int, stages: int) -> list[list[tuple[int, int]]]:
    """The forward of GPipe's paper in clock cycles: at cycle ``t``, micro-batch ``i`` runs on stage ``t - i``.

    Each inner list holds the (micro-batch, stage) pairs that run at the same time; the backward is the
    same diagram in reverse. There are ``chunks + stages - 1`` cycles.

    >>> clock_cycles(2, 2)
    [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    """
    return [[(t - s, s) for s in range(stages) if 0 <= t - s < chunks] for t in range(chunks + stages - 1)]


def bubble_fraction(chunks: int, stages: int) -> float:
    """The idle share of a fill-drain step with equal stages: ``(K - 1) / (M + K - 1)``."""
    return (stages - 1) / (chunks + stages - 1)
