"""One training step of the pipeline, replayed on costs: when each pass runs, how long the step takes, peak memory.

The replay follows the engine's own schedule (:func:`lightning_gpipe.engine.schedule.fill_drain`, run
by :class:`lightning_gpipe.engine.stage.StageRunner`), not a formula, so that what a formula leaves out
is in it: stages of unequal cost, the link's latency and bandwidth, the last stage's output share to
every stage before any drain can start, recomputes that overlap the wait for an output gradient, and
a stage that must wait for its sends to be delivered before it returns. Per stage:

1. **Fill**: micro-batch ``i`` starts when the stage is free and the previous stage's output for it has
   arrived (sends do not block the sender: the engine's ``isend``).
2. **Share**: the last stage sends the joined output to every other stage; each stage waits for it, and
   the last stage waits for its delivery (the engine's ``flush``).
3. **Head**: the loss and the layers outside the backbone, on every rank (``head`` seconds).
4. **Drain**: micro-batches in reverse; a checkpointed one is recomputed first (it needs nothing from the
   next stage, so it overlaps the wait), then its backward starts when its output gradient has arrived;
   the input gradient goes to the previous stage. The stage ends when its last send is delivered, plus
   ``update`` seconds (the optimizer), which needs ``update_working`` bytes while it runs.

Messages on one link (a pair of stages, one direction) go one after another. Memory is followed along
the same tasks: a stage holds its state (parameters, gradients, optimizer state) and the backbone's
output, and, per micro-batch between its forward and its backward, everything its forward saves or
only its input when checkpointed; a recompute restores the rest for the backward, and a pass needs its
working bytes while it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpipe.balancing.plan.link import LinkModel
from lightning_gpipe.engine.checkpoint import check_checkpoint_mode, checkpointed
from lightning_gpipe.engine.schedule import fill_drain

__all__ = ["Prediction", "Span", "StageCost", "StagePrediction", "StepCosts", "simulate"]


@dataclass(frozen=True)
class StageCost:
    """What one micro-batch costs one stage: seconds of each pass, and bytes.

    ``kept`` is what a micro-batch that is not checkpointed holds from its forward to its backward (its
    input, the activations its layers save, its output); ``input`` is what a checkpointed one holds;
    ``output`` crosses to the next stage (and its gradient comes back); ``working`` is held only while a
    pass runs (the gradients flowing through a backward, a layer's input and output in a forward
    without a graph).
    """

    forward: float
    backward: float
    recompute: float
    kept: int = 0
    input: int = 0
    output: int = 0
    working: int = 0


@dataclass(frozen=True)
class StepCosts:
    """A step's costs: ``micro[stage][i]`` for every stage and micro-batch, and what is per stage or per step.

    ``state`` is each stage's parameter, gradient and optimizer-state bytes; ``output`` the bytes of the
    backbone's output for the whole batch (shared to every stage); ``head`` the seconds every rank
    spends between its fill and its drain (the loss, layers outside the backbone); ``update`` each
    stage's seconds after its drain (the optimizer step), and ``update_working`` the bytes that step
    allocates beyond the state while it runs.
    """

    micro: Sequence[Sequence[StageCost]]
    state: Sequence[int]
    output: int = 0
    head: float = 0.0
    update: Sequence[float] = ()
    update_working: Sequence[int] = ()

    def __post_init__(self) -> None:
        if not self.micro or not self.micro[0]:
            raise ValueError("A step needs at least one stage and one micro-batch.")
        if any(len(row) != len(self.micro[0]) for row in self.micro):
            raise ValueError("Every stage must have a cost for every micro-batch.")
        given = [x for x in (self.update, self.update_working) if x]
        if len(self.state) != len(self.micro) or any(len(x) != len(self.micro) for x in given):
            raise ValueError("`state` (and `update` and `update_working`, if given) need one entry per stage.")


@dataclass(frozen=True)
class Span:
    """One pass in the replayed step: ``kind`` is ``"forward"``, ``"recompute"`` or ``"backward"``."""

    stage: int
    kind: str
    micro: int
    start: float
    end: float


@dataclass(frozen=True)
class StagePrediction:
    """One stage's step: seconds per pass kind, busy (their sum), idle (the rest of the step), peak bytes."""

    forward: float
    recompute: float
    backward: float
    idle: float
    peak_memory: int

    @property
    def busy(self) -> float:
        return self.forward + self.recompute + self.backward

    @property
    def utilization(self) -> float:
        total = self.busy + self.idle
        return self.busy / total if total > 0 else 0.0


@dataclass(frozen=True)
class Prediction:
    """A replayed step: its seconds, its bubble, each stage, the passes.

    The bubble is the one :class:`~lightning_gpipe.PipelineMonitor` measures: one minus the stages' summed busy
    time over ``K`` windows, the window being the first stage's fill (up to the output share) and drain. It leaves
    out the head and the optimizer step, which no stage's passes could fill: a one-stage step has no bubble. (One
    over the whole step instead read 0.21 for the main job at K=1, where the monitor measured 0.01.)
    """

    step: float
    stages: tuple[StagePrediction, ...]
    timeline: tuple[Span, ...]
    #: The first stage's fill and drain, in seconds (the monitor's window); 0 reads as the whole step.
    window: float = 0.0

    @property
    def bubble(self) -> float:
        window = self.window if self.window > 0 else self.step
        if window <= 0:
            return 0.0
        return max(1.0 - sum(s.busy for s in self.stages) / (len(self.stages) * window), 0.0)

    @property
    def peak_memory(self) -> int:
        """The largest stage's peak: what must fit on each device."""
        return max(s.peak_memory for s in self.stages)


class _Links:
    """Point-to-point links, one per (source, destination): messages on one go one after another."""

    def __init__(self, model: LinkModel) -> None:
        self.model = model
        self.free: dict[tuple[int, int], float] = {}

    def send(self, src: int, dst: int, at: float, nbytes: int) -> float:
        """The arrival time of ``nbytes`` that ``src`` sends to ``dst`` at ``at``."""
        start = max(at, self.free.get((src, dst), 0.0))
        transfer = nbytes / self.model.bandwidth
        self.free[(src, dst)] = start + transfer
        return start + transfer + self.model.latency


class _Memory:
    """A stage's bytes along its tasks, and the most it held."""

    def __init__(self, held: int) -> None:
        self.held = self.peak = held

    def during(self, extra: int) -> None:
        self.peak = max(self.peak, self.held + extra)

    def add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)


def simulate(costs: StepCosts, checkpoint: str, link: LinkModel = LinkModel()) -> Prediction:
    """Replay one training step of ``costs`` under ``checkpoint`` (any mode of ``GPipe``) over ``link``.

    >>> one = StageCost(forward=1.0, backward=2.0, recompute=1.0)
    >>> step = simulate(StepCosts([[one] * 4] * 2, state=[0, 0]), "never")
    >>> step.step, round(step.bubble, 3)  # (M + K - 1) * (f + b) and (K - 1) / (M + K - 1)
    (15.0, 0.2)
    """
    check_checkpoint_mode(checkpoint)
    stages, count = len(costs.micro), len(costs.micro[0])
    forward_tasks, backward_tasks = fill_drain(count, checkpoint)
    links = _Links(link)
    spans: list[Span] = []
    memory = [_Memory(costs.state[s]) for s in range(stages)]
    arrival = [0.0] * count  # when the current stage's input for micro-batch i arrives
    fill_end = [0.0] * stages
    for s in range(stages):  # the fill: stage s needs only stage s - 1
        now, sent = 0.0, [0.0] * count
        for task in forward_tasks:
            i, c = task.micro, costs.micro[s][task.micro]
            start = max(now, arrival[i])
            now = start + c.forward
            spans.append(Span(s, "forward", i, start, now))
            dropped = checkpointed(checkpoint, i, count)
            memory[s].during(c.working if dropped else 0)
            memory[s].add(c.input if dropped else c.kept)
            if s < stages - 1:
                sent[i] = links.send(s, s + 1, now, c.output)
        fill_end[s], arrival = now, sent
    last = stages - 1
    shared = [links.send(last, s, fill_end[last], costs.output) for s in range(last)]
    ready = [max(fill_end[s], shared[s]) for s in range(last)] + [max([fill_end[last], *shared])]
    for s in range(stages):
        memory[s].add(costs.output * (2 if s == last else 1))  # the last stage joins its outputs into one
    ends, drained = [0.0] * stages, [0.0] * stages
    gradient = [0.0] * count  # when the current stage's output gradient for micro-batch i arrives
    for s in reversed(range(stages)):  # the drain: stage s needs only stage s + 1
        now = ready[s] + costs.head
        sent, delivered = [0.0] * count, now
        for task in backward_tasks:
            i, c = task.micro, costs.micro[s][task.micro]
            if task.kind == "recompute":
                start, now = now, now + c.recompute
                memory[s].add(c.kept - c.input)
            else:
                start = max(now, gradient[i] if s < last else 0.0)
                now = start + c.backward
                memory[s].during(c.working)
                memory[s].add(-c.kept)
                if s > 0:
                    sent[i] = links.send(s, s - 1, now, costs.micro[s - 1][i].output)
                    delivered = max(delivered, sent[i])
            spans.append(Span(s, task.kind, i, start, now))
        drained[s] = max(now, delivered)
        ends[s] = drained[s] + (costs.update[s] if costs.update else 0.0)
        memory[s].during(costs.update_working[s] if costs.update_working else 0)
        gradient = sent
    step = max(ends)
    per_stage = []
    for s in range(stages):
        total = {kind: sum(x.end - x.start for x in spans if x.stage == s and x.kind == kind) for kind in _KINDS}
        busy = sum(total.values())
        per_stage.append(
            StagePrediction(total["forward"], total["recompute"], total["backward"], step - busy, memory[s].peak)
        )
    window = drained[0] - costs.head  # the first stage's fill, to the share, and its drain: the head between them
    return Prediction(step, tuple(per_stage), tuple(sorted(spans, key=lambda x: (x.start, x.stage))), window)


_KINDS = ("forward", "recompute", "backward")
