"""Layer costs at any micro-batch size, and a split's step costs, from profiles at one or more sizes.

A profile (:func:`~lightning_gpipe.balancing.profile_layers`) measures one micro-batch size. The
planner weighs many: M micro-batches of a batch of B samples are ``B / M`` each. Time is not
proportional to the micro-batch size (a small one pays a fixed cost per layer: kernel launches,
Python), so each layer's time is read off a line through profiles at two or more sizes (piecewise
linear between them, the end segments extended beyond); memory is proportional to the size, which
the same lines give. One profile alone is scaled in proportion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_gpipe.balancing.plan.replay import StageCost, StepCosts
from lightning_gpipe.balancing.profiling import LayerCosts
from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.partition import stage_bounds

__all__ = ["CostModel", "LayerRow", "UpdateCosts"]

_FIELDS = (
    "forward",
    "backward",
    "activation_bytes",
    "output_bytes",
    "input_counted",
    "output_counted",
    "backward_working",
)


@dataclass(frozen=True)
class LayerRow:
    """One layer's costs for one micro-batch of a given size (see :class:`LayerCosts`)."""

    forward: float
    backward: float
    activation_bytes: float
    output_bytes: float
    input_counted: float
    output_counted: float
    backward_working: float


@dataclass(frozen=True)
class UpdateCosts:
    """Each layer's optimizer step (see :func:`~lightning_gpipe.balancing.plan.measure_updates`): ``times`` in
    seconds, and the ``working`` bytes it allocates beyond the parameters, gradients and state (temporaries such
    as Adam's denominator); either may be empty (not measured: free). ``together``: the optimizer updates all of
    a stage's tensors in one go (torch's foreach kernels, its default on CUDA), so a stage's temporaries add up;
    otherwise one tensor at a time (its default on the CPU), so the largest layer's count.
    """

    times: Sequence[float] = ()
    working: Sequence[int] = ()
    together: bool = False

    def per_stage(self, bounds: Sequence[tuple[int, int]]) -> tuple[list[float], list[int]]:
        """Each stage's seconds and working bytes, for stages of layers ``start..stop - 1``."""
        times = [sum(self.times[a:b]) for a, b in bounds] if self.times else []
        if not self.working:
            return times, []
        combine = sum if self.together else (lambda part: max(part, default=0))
        return times, [int(combine(self.working[a:b])) for a, b in bounds]


class CostModel:
    """Per-layer costs at any micro-batch size, from one or more :class:`LayerCosts` of different ``batch``.

    >>> small = LayerCosts([0], [3.0], [0], [4], forward=(1.0,), backward=(2.0,), output_bytes=(4,),
    ...                    input_counted=(4,), output_counted=(0,), batch=1)
    >>> large = LayerCosts([0], [7.0], [0], [16], forward=(3.0,), backward=(4.0,), output_bytes=(16,),
    ...                    input_counted=(16,), output_counted=(0,), batch=4)
    >>> CostModel([small, large]).layers(2)[0].forward  # on the line through (1, 1.0) and (4, 3.0)
    1.6666666666666665
    """

    def __init__(self, profiles: Sequence[LayerCosts], update: Optional[UpdateCosts] = None) -> None:
        if not profiles:
            raise ValueError("The planner needs at least one profile of the backbone's layers.")
        for costs in profiles:
            if costs.batch < 1 or len(costs.forward) != len(costs.params):
                raise ValueError(
                    "The planner needs profiles from `profile_layers` (with forward and backward times and the "
                    "micro-batch size), not costs built by hand."
                )
        layers = {len(c.params) for c in profiles}
        if len(layers) != 1:
            raise ValueError(f"The profiles are of backbones of different lengths: {sorted(layers)} layers.")
        by_size = {c.batch: c for c in profiles}  # one per size: the last given wins
        self.profiles = [by_size[b] for b in sorted(by_size)]
        self.state_bytes = list(self.profiles[0].state_bytes)
        self.params = list(self.profiles[0].params)
        #: Each layer's optimizer step (empty: not measured, counted as free).
        self.update = update if update is not None else UpdateCosts()
        for values, what in ((self.update.times, "time"), (self.update.working, "size")):
            if values and len(values) != len(self.params):
                raise ValueError(f"`update` needs one {what} per layer ({len(self.params)}), got {len(values)}.")
        #: Whether the profiles measured each layer's backward working bytes (see :class:`LayerCosts`).
        self.measured_working = all(len(c.backward_working) == len(self.params) for c in self.profiles)
        #: Whether each layer's output left a stage in every profile: at a micro-batch of 1 a sequence-first tensor
        #: such as an LSTM's ``h`` has the samples' count in dim 0 too (see :class:`LayerCosts`).
        self.crossable = [all(flags) for flags in zip(*(c.crossable for c in self.profiles))]

    def __len__(self) -> int:
        return len(self.params)

    def layers(self, size: float) -> list[LayerRow]:
        """Every layer's costs for a micro-batch of ``size`` samples."""
        values = {name: self._at(name, size) for name in _FIELDS}
        return [LayerRow(*(values[name][j] for name in _FIELDS)) for j in range(len(self))]

    def _at(self, name: str, size: float) -> list[float]:
        points = [(c.batch, getattr(c, name) or (0,) * len(self)) for c in self.profiles]
        if len(points) == 1:
            batch, values = points[0]
            return [float(v) * size / batch for v in values]
        k = 1
        while k < len(points) - 1 and points[k][0] < size:
            k += 1
        (x0, y0), (x1, y1) = points[k - 1], points[k]
        return [max(float(a) + (float(b) - float(a)) * (size - x0) / (x1 - x0), 0.0) for a, b in zip(y0, y1)]

    def time(self, size: float) -> list[float]:
        """Forward plus backward of each layer at ``size``: the cost a split by time balances."""
        return [row.forward + row.backward for row in self.layers(size)]

    def memory(self, size: float) -> list[float]:
        """Each layer's state plus the activations it saves at ``size``: the cost a split by memory balances."""
        return [state + row.activation_bytes for state, row in zip(self.state_bytes, self.layers(size))]

    def step_costs(
        self,
        balance: Sequence[int],
        batch_size: int,
        chunks: int,
        head: float = 0.0,
    ) -> StepCosts:
        """The costs of one step of ``batch_size`` samples in ``chunks`` micro-batches over the split ``balance``.

        Micro-batch sizes are the engine's (:func:`lightning_gpipe.engine.microbatch.split_sizes`).
        """
        sizes = microbatch.split_sizes(batch_size, chunks)
        bounds = stage_bounds(balance)
        rows = {size: self.layers(size) for size in set(sizes)}
        micro: list[list[StageCost]] = []
        for start, stop in bounds:
            micro.append([self._stage(rows[size], start, stop, size) for size in sizes])
        state = [int(sum(self.state_bytes[a:b])) for a, b in bounds]
        last = self.layers(batch_size)[-1]
        times, working = self.update.per_stage(bounds)
        return StepCosts(micro, state, output=int(last.output_bytes), head=head, update=times, update_working=working)

    def _stage(self, rows: list[LayerRow], start: int, stop: int, size: int) -> StageCost:
        """One micro-batch on layers ``start..stop - 1``: a stage's passes, and what it keeps (each tensor once)."""
        part = rows[start:stop]
        if start == 0:
            received = part[0].input_counted  # a view of the batch: held only where the first layer saves it
        else:
            received = rows[start - 1].output_bytes  # a received message, held for the backward in any case
        output = part[-1].output_bytes
        activations = sum(r.activation_bytes for r in part)
        kept = activations - part[0].input_counted + received + output - part[-1].output_counted
        if self.measured_working:  # each layer's backward: the gradient arriving, plus what the backward allocates
            working = max(r.output_bytes + r.backward_working for r in part)
        else:  # a profile without it: a layer's backward holds gradients of about what its forward saved
            working = max(max(r.activation_bytes + r.output_bytes for r in part), 2 * received)
        forward = sum(r.forward for r in part)
        return StageCost(
            forward=forward,
            backward=sum(r.backward for r in part),
            recompute=forward,
            kept=int(kept),
            input=int(received),
            output=int(output),
            working=int(working),
        )
