"""``chunks="auto"``, ``checkpoint="auto"``, ``balance="auto"``: what the strategy asks the planner, as one call.

The strategy profiles on one rank and shares the answer (:meth:`GPipeStrategy._plan`); this module is
the plain part: which candidates the user's fixed settings leave open, the plan, and what to log.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Union

import torch
from torch import nn

from lightning_gpipe.balancing.plan.costs import CostModel
from lightning_gpipe.balancing.plan.link import LinkModel
from lightning_gpipe.balancing.plan.measure import micro_batch_sizes, profile_for_plan
from lightning_gpipe.balancing.plan.search import Splitter, by_time, checkpoint_modes, chunk_grid, plan, plan_table
from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.partition import balance_keeping_together, kept_together, parameter_costs

__all__ = ["AUTO", "AutoChoice", "choose"]

#: The value of ``chunks``, ``checkpoint`` or ``balance`` that asks the planner.
AUTO = "auto"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> float:
    """``"16GiB"``, ``"512MB"``, ``"1e9"``: a number of bytes (``max_memory``, the CLI's ``--memory``).

    >>> parse_bytes("16GiB"), parse_bytes("1.5kb"), parse_bytes("100")
    (17179869184.0, 1500.0, 100.0)
    """
    found = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else ""
    try:
        number = float(found.group(1)) if found is not None and unit in _UNITS else None
    except ValueError:
        number = None
    if number is None:
        raise ValueError(f"{text!r} is not a size: write a number and B, KB, MB, GB, KiB, MiB or GiB.")
    return number * _UNITS[unit]


@dataclass(frozen=True)
class AutoChoice:
    """What the planner chose, the table it logs, and the seconds it took (profiling included)."""

    chunks: int
    checkpoint: str
    balance: list[int]
    table: str
    seconds: float


def _splitter(balance: Union[str, Sequence[int]], together: list[tuple[int, int]], module: nn.Sequential) -> Splitter:
    """How ``balance`` splits, keeping each range of ``together`` on one stage (see ``partition.kept_together``)."""
    if not isinstance(balance, str):
        fixed = list(balance)
        return lambda model, stages, size: fixed
    if balance == "params":
        params = parameter_costs(module)
        return lambda model, stages, size: balance_keeping_together(params, stages, together)
    if balance == "memory":
        return lambda model, stages, size: balance_keeping_together(model.memory(size), stages, together)
    # "time" and "auto" start from the split by time; "auto" then searches near it (`plan`)
    return (
        by_time
        if not together
        else lambda model, stages, size: balance_keeping_together(model.time(size), stages, together)
    )


def choose(
    module: nn.Sequential,
    sample: Any,
    stages: int,
    chunks: Union[int, str],
    checkpoint: str,
    balance: Union[str, Sequence[int]],
    device: torch.device,
    max_memory: Optional[float] = None,
    link: LinkModel = LinkModel(),
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
) -> tuple[AutoChoice, CostModel]:
    """Profile ``module`` on ``sample`` (the backbone's input for one whole batch) and plan what is ``"auto"``."""
    start = time.perf_counter()
    batch_size = microbatch.batch_size(sample)
    grid = chunk_grid(batch_size) if chunks == AUTO else [min(int(chunks), batch_size)]
    model = profile_for_plan(module, sample, micro_batch_sizes(batch_size, grid), device, context=context)
    modes = checkpoint_modes if checkpoint == AUTO else (lambda m: [checkpoint])
    together = kept_together(module, model.crossable)
    splits = [_splitter(balance, together, module)]
    search = balance == AUTO and not together  # the search moves single cuts, into a span kept together too
    result = plan(model, stages, batch_size, link, max_memory, grid, modes, splits, search=search)
    best = result.choice
    return (
        AutoChoice(
            best.chunks, best.checkpoint, list(best.balance), plan_table(result, rows=5), time.perf_counter() - start
        ),
        model,
    )
