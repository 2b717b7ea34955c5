"""Models with skip connections across stages, and a worker that trains a list of cases on K stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_gpipe import GPipe, PopCat, Stash, pop, skippable, stash
from lightning_gpipe.engine.skip import declared

WIDTH = 12
BATCH = 8
STEPS = 3


@skippable()
class Mix(nn.Module):
    """A Linear and tanh that adds the skips it pops and stashes a scaled copy of its output under each name."""

    def __init__(self, width_in: int, stashes=(), pops=(), dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, WIDTH)
        self.dropout = nn.Dropout(dropout)
        self.stashes, self.pops = list(stashes), list(pops)
        declared(self, stash=self.stashes, pop=self.pops)

    def forward(self, x):
        h = torch.tanh(self.dropout(self.linear(x)))
        for k, name in enumerate(self.pops):
            h = h + (0.5 + k) * pop(name)
        for k, name in enumerate(self.stashes):
            stash(name, h * (1.0 + 0.25 * k))
        return h


def model(dropout: float = 0.0) -> nn.Sequential:
    """9 layers whose skips span 1, 2 and 3 stages at K = 4 (balance [2, 2, 2, 3]), one stays on its stage
    (s4), several cross the first boundary in one bundle (s1, s6), and one stashes a stage's input (x)."""
    torch.manual_seed(0)
    return nn.Sequential(
        Mix(6, stashes=["s3", "s6"]),
        Mix(WIDTH, stashes=["s1", "s5"], dropout=dropout),
        Stash("x"),
        Mix(WIDTH, pops=["s1", "s6"], stashes=["s2"]),
        Mix(WIDTH, stashes=["s4"], dropout=dropout),
        Mix(WIDTH, pops=["s4", "s5"]),
        PopCat("x"),
        Mix(2 * WIDTH, pops=["s2", "s3"]),
        nn.Linear(WIDTH, 3),
    )


#: Balances of the 14-layer U-Net (depth 2, one unit a level) per K. Level 0's skip goes from layer 1 to layer 11,
#: level 1's from 4 to 8: at K = 2 both cross; at K = 3 level 1's stays on stage 1 and level 0's spans 2 stages; at
#: K = 4 level 0's spans 3 stages and level 1's 1.
UNET_BALANCES = {1: [14], 2: [7, 7], 3: [4, 5, 5], 4: [3, 4, 4, 3]}

#: Balances per K; the first of each puts the skips as ``model`` describes, the second is lopsided.
BALANCES = {1: [[9]], 2: [[4, 5], [1, 8]], 3: [[3, 3, 3], [1, 1, 7]], 4: [[2, 2, 2, 3], [1, 6, 1, 1]]}


@dataclass(frozen=True)
class Case:
    balance: tuple[int, ...]
    chunks: int
    checkpoint: str
    dropout: float = 0.0
    unet: bool = False
    split: bool = False  # GPipe(split_backward=True): input gradients first in the drain

    @property
    def name(self) -> str:
        kind = "unet" if self.unet else "mix"
        split = " split" if self.split else ""
        return (
            f"{kind} balance={list(self.balance)} chunks={self.chunks} {self.checkpoint} dropout={self.dropout}{split}"
        )


def build(case: Case) -> nn.Sequential:
    if case.unet:
        from lightning_gpipe.models import unet

        torch.manual_seed(0)
        return unet(depth=2, num_convs=1, base_channels=4, input_channels=1, output_channels=1, dropout=case.dropout)
    return model(case.dropout)


def data(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    if case.unet:
        return [
            (
                torch.randn(BATCH, 1, 9, 11, generator=generator),
                (torch.rand(BATCH, 1, 9, 11, generator=generator) > 0.5).float(),
            )
            for _ in range(STEPS)
        ]
    return [
        (torch.randn(BATCH, 6, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
        for _ in range(STEPS)
    ]


def loss_of(case: Case, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(out, y) if case.unet else F.cross_entropy(out, y)


def train(case: Case, net: nn.Module, named: Optional[list[tuple[str, nn.Parameter]]] = None) -> dict[str, Any]:
    """``STEPS`` of SGD with momentum on ``case``'s data (see :func:`train_on`)."""
    return train_on(net, data(case), lambda out, y: loss_of(case, out, y), named)


def train_on(
    net: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    named: Optional[list[tuple[str, nn.Parameter]]] = None,
) -> dict[str, Any]:
    """SGD with momentum, a step per batch: the losses, the gradients of step 1 and the weights at the end."""
    named = named if named is not None else list(net.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)
    losses, grads = [], {}
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        loss = loss_fn(net(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "weights": {n: p.detach().clone() for n, p in named}}


def reference(case: Case) -> dict[str, Any]:
    """The same training on one device, without the pipeline (the skips go through the per-thread tracker)."""
    return train(case, build(case))


def pipeline(case: Case) -> dict[str, Any]:
    pipe = GPipe(
        build(case), list(case.balance), chunks=case.chunks, checkpoint=case.checkpoint, split_backward=case.split
    )
    try:
        return {**train(case, pipe), "split_passes": pipe.runner.split_passes}
    finally:
        pipe.close()


def replicas(rank: int) -> dict[str, Any]:
    """``STEPS`` on ``PipeLayout(4, 2)``: replica ``rank // 2`` trains on its half of every batch of 16."""
    from lightning_gpipe import PipeLayout

    case = Case((4, 5), 3, "except_last")
    pipe = GPipe(build(case), [4, 5], chunks=3, checkpoint="except_last", layout=PipeLayout(4, 2))
    half = slice(0, BATCH) if rank < 2 else slice(BATCH, 2 * BATCH)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for x, y in double_data():
        optimizer.zero_grad()
        loss_of(case, pipe(x[half]), y[half]).backward()
        pipe.sync_gradients()
        optimizer.step()
    weights = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return weights


def double_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [
        (torch.randn(2 * BATCH, 6, generator=generator), torch.randint(0, 3, (2 * BATCH,), generator=generator))
        for _ in range(STEPS)
    ]


def replicas_reference() -> dict[str, torch.Tensor]:
    """The same steps on one device, on the whole batches of 16."""
    case = Case((9,), 1, "never")
    net = build(case)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in double_data():
        optimizer.zero_grad()
        loss_of(case, net(x), y).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def sweep(rank: int, world_size: int, cases: list[Case]) -> dict[str, Any]:
    """Every case on ``world_size`` stages; plus the bytes each stage sent in one training step of the first."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {case.name: pipeline(case) for case in cases}
    first = cases[0]
    pipe = GPipe(build(first), list(first.balance), chunks=2, checkpoint="never")
    x, y = data(first)[0]
    loss_of(first, pipe(x), y).backward()
    results["bytes_sent"] = pipe.bytes_sent()
    pipe.close()
    if world_size == 4:  # two data-parallel replicas of a 2-stage pipeline, each on its half of a batch of 16
        results["replicas"] = replicas(rank)
    dist.destroy_process_group()
    return results
