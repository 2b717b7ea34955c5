"""The planner's profile: the backbone's layers measured at the micro-batch sizes a plan weighs.

One profile per size: a layer's time at a small micro-batch is mostly fixed cost, at a large one
mostly per-sample cost, and no single size tells both (see :mod:`.costs`). Each profile is
:func:`~lightning_gpipe.balancing.profile_layers` on the first ``size`` samples of one batch of the
backbone's input, so the plan's costs come from the data it will train on. Each layer's optimizer
step is measured too (:func:`measure_updates`): it ends every stage's step, after its drain, and its
temporaries can be a stage's peak when checkpointing leaves few activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterable
from functools import partial
from typing import Any, Callable, ContextManager, Union

import torch
from torch import Tensor, nn

from lightning_gpipe.balancing.live_bytes import LiveBytes
from lightning_gpipe.balancing.plan.costs import CostModel, UpdateCosts
from lightning_gpipe.balancing.profiling import LayerCosts, profile_layers, synchronize
from lightning_gpipe.engine import microbatch

__all__ = ["measure_updates", "micro_batch_sizes", "profile_for_plan"]


def micro_batch_sizes(batch_size: int, chunks: Iterable[int]) -> list[int]:
    """The largest micro-batch of each M for a batch of ``batch_size`` (what the engine cuts), ascending.

    >>> micro_batch_sizes(10, [1, 2, 4, 8])
    [2, 3, 5, 10]
    """
    return sorted({microbatch.split_sizes(batch_size, min(m, batch_size))[0] for m in chunks})


def profile_for_plan(
    module: nn.Sequential,
    sample: Any,
    sizes: Iterable[int],
    device: Union[torch.device, str, None] = None,
    *,
    repeats: int = 5,
    optimizer_states: float = 2.0,
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> CostModel:
    """Profile ``module`` on the first ``size`` samples of ``sample`` (the backbone's input) for each of ``sizes``.

    The sizes take turns: ``repeats`` rounds of one timed sweep of each size (the first round also counts the
    bytes), and each layer keeps its fastest round at each size. On a shared machine other work only ever slows
    a sweep down, and a slow spell now costs each size one round rather than one size every sweep: on CPU-2,
    all sweeps of one size in a row had come out 1.3-1.5x slow in some runs, which put the plan's cells of that
    size 25-98% off the measured steps. (A step is measured the same way, as the fastest of several.)
    """
    available = microbatch.batch_size(sample)
    wanted = sorted({min(int(s), available) for s in sizes})
    parts = [microbatch.map_tensors(partial(_first, size), sample) for size in wanted]
    options: dict[str, Any] = {"optimizer_states": optimizer_states, "context": context}
    profiles = [profile_layers(module, part, device, repeats=1, **options) for part in parts]
    for _ in range(repeats - 1):
        again = [profile_layers(module, part, device, repeats=1, count=False, **options) for part in parts]
        profiles = [_fastest(first, second) for first, second in zip(profiles, again)]
    return CostModel(profiles, update=measure_updates(module, device, optimizer_states=optimizer_states))


def _fastest(kept: LayerCosts, new: LayerCosts) -> LayerCosts:
    """``kept``'s bytes with each layer's faster forward and backward of the two profiles."""
    forward = tuple(map(min, kept.forward, new.forward))
    backward = tuple(map(min, kept.backward, new.backward))
    return dataclasses.replace(
        kept, forward=forward, backward=backward, time=[f + b for f, b in zip(forward, backward)]
    )


def measure_updates(
    module: nn.Sequential,
    device: Union[torch.device, str, None] = None,
    *,
    optimizer_states: float = 2.0,
    repeats: int = 5,
) -> UpdateCosts:
    """One optimizer step over each layer's trainable parameters, timed and its bytes followed, on copies moved
    to ``device``.

    The optimizer does not exist when the plan is made (Lightning builds it for the local stage after
    the split), so it is assumed as :func:`~lightning_gpipe.balancing.state_bytes` assumes its state:
    2 states per parameter is Adam, 1 is SGD with momentum, 0 plain SGD. Copies keep the module's
    parameters and any optimizer untouched; the median of ``repeats`` steps after a first one (which
    creates the state) is the time, and one more step, followed by :class:`LiveBytes`, gives the bytes.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    times, working, together = [], [], False
    for layer in module:
        params = [p.detach().to(device).clone().requires_grad_() for p in layer.parameters() if p.requires_grad]
        if not params:
            times.append(0.0)
            working.append(0)
            continue
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer = _assumed_optimizer(params, optimizer_states)
        together = together or _updates_together(params)
        samples = []
        for attempt in range(repeats + 1):
            synchronize(device)
            start = time.perf_counter()
            optimizer.step()
            synchronize(device)
            if attempt:
                samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
        with LiveBytes.training(params, optimizer) as live:
            live.mark("start")
            optimizer.step()
        working.append(max(live.peak("start") - live.held("start"), 0))
    return UpdateCosts(times, working, together)


def _updates_together(params: list[Tensor]) -> bool:
    # torch's own rule for an optimizer left at its default implementation; no public function tells it
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return bool(_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1])


def _assumed_optimizer(params: list[Tensor], states: float) -> torch.optim.Optimizer:
    if states >= 2:
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if states >= 1 else 0.0)


def _first(size: int, t: Tensor) -> Tensor:
    """The first ``size`` samples as a fresh tensor: its memory counts at the micro-batch's size."""
    return t[:size].detach().clone().requires_grad_(t.requires_grad)
