"""Workers for ``tests/test_split_backward.py``: layers the split backward must not get wrong, in a real pipeline.

Stage 1 of :func:`build` (K=4, balance ``BALANCE``) has a gradient hook on the activation a Linear's weight
gradient is made from (the weight pass must not apply it a second time); stage 2 has a layer under a
reentrant ``torch.utils.checkpoint``, which refuses a restricted backward (that stage must run whole); stage 3
splits. In the same four processes, :func:`replicas` trains two data-parallel replicas of a two-stage pipeline
with the split drain (the gradient sync fires on the weight pass's accumulations).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _skip_workers import train_on
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_gpipe import GPipe

BALANCE = [2, 2, 2, 2]
REPLICA_BALANCE = [2, 6]
STEPS = 3
BATCH = 6
#: (chunks, checkpoint mode) of every pipeline run
CASES = [(3, "never"), (3, "always"), (2, "except_last"), (3, "keep:1")]


class Hooked(nn.Module):
    """A Linear whose output gradient is doubled by a tensor hook (``register_hook``) on every forward with grad."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(lambda g: g * 2)
        return y


class Reentrant(nn.Module):
    """A Linear under ``torch.utils.checkpoint(..., use_reentrant=True)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.linear, x, use_reentrant=True) if x.requires_grad else self.linear(x)


def build(reentrant: bool = True) -> nn.Sequential:
    """Eight layers; without ``reentrant``, a plain Linear where the checkpointed one is."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8),
        nn.Tanh(),
        Hooked(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        Reentrant(8) if reentrant else nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    )


def data(batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, 5, generator=generator), torch.randint(0, 3, (batch,), generator=generator))
        for _ in range(STEPS)
    ]


def train(net: nn.Module) -> dict[str, Any]:
    """``STEPS`` of SGD with momentum: the losses, the gradients of step 1 and the weights at the end."""
    return train_on(net, data(), F.cross_entropy)


def reference() -> dict[str, Any]:
    """The same training on one process, without the pipeline."""
    return train(build())


def replicas_reference() -> dict[str, torch.Tensor]:
    """:func:`replicas`' steps on one device, on the whole batches of ``2 * BATCH``: the weights at the end."""
    net = build(reentrant=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in data(2 * BATCH):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def replicas(rank: int) -> dict[str, Any]:
    """``PipeLayout(4, 2)`` with the split drain: replica ``rank // 2`` trains on its half of every batch."""
    from lightning_gpipe import PipeLayout

    pipe = GPipe(
        build(reentrant=False),
        REPLICA_BALANCE,
        chunks=3,
        checkpoint="except_last",
        layout=PipeLayout(4, 2),
        split_backward=True,
    )
    half = slice(0, BATCH) if rank < 2 else slice(BATCH, 2 * BATCH)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for x, y in data(2 * BATCH):
        optimizer.zero_grad()
        F.cross_entropy(pipe(x[half]), y[half]).backward()
        pipe.sync_gradients()
        optimizer.step()
    result = {
        "weights": {n: p.detach().clone() for n, p in pipe.named_parameters()},
        "split_passes": pipe.runner.split_passes,
    }
    pipe.close()
    return result


def sweep(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Every case of :data:`CASES` with ``split_backward=True``, then :func:`replicas`, in one process group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for chunks, mode in CASES:
        pipe = GPipe(build(), BALANCE, chunks=chunks, checkpoint=mode, split_backward=True)
        try:
            results[f"{chunks}-{mode}"] = {**train(pipe), "split_passes": pipe.runner.split_passes}
        finally:
            pipe.close()
    results["replicas"] = replicas(rank)
    dist.destroy_process_group()
    return results
