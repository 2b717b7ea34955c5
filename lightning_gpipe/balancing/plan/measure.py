"""The planner's profile: the backbone's layers measured at the micro-batch sizes a plan weighs.

One profile per size: a layer's time at a small micro-batch is mostly fixed cost, at a large one
mostly per-sample cost, and no single size tells both (see :mod:`.costs`). Each profile is
:func:`~lightning_gpipe.balancing.profile_layers` on the first ``size`` samples of one batch of the
backbone's input, so the plan's costs come from the data it will train on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from functools import partial
from typing import Any, Callable, ContextManager, Union

import torch
from torch import Tensor, nn

from lightning_gpipe.balancing.plan.costs import CostModel
from lightning_gpipe.balancing.profiling import profile_layers
from lightning_gpipe.engine import microbatch

__all__ = ["micro_batch_sizes", "profile_for_plan"]


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
    """Profile ``module`` on the first ``size`` samples of ``sample`` (the backbone's input) for each of ``sizes``."""
    available = microbatch.batch_size(sample)
    wanted = sorted({min(int(s), available) for s in sizes})
    profiles = []
    for size in wanted:
        part = microbatch.map_tensors(partial(_first, size), sample)
        profiles.append(
            profile_layers(module, part, device, repeats=repeats, optimizer_states=optimizer_states, context=context)
        )
    return CostModel(profiles)


def _first(size: int, t: Tensor) -> Tensor:
    """The first ``size`` samples as a fresh tensor: its memory counts at the micro-batch's size."""
    return t[:size].detach().clone().requires_grad_(t.requires_grad)
