"""Ready-made skip layers: :class:`Stash` keeps its input, :class:`PopCat` and :class:`PopAdd` merge it back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gpipe.engine.skip.declare import declared, pop, skippable, stash

__all__ = ["PopAdd", "PopCat", "Stash"]


@skippable()
class Stash(nn.Module):
    """Stash the input under ``name`` and pass it on unchanged.

    >>> block = nn.Sequential(Stash("x"), nn.Linear(4, 4), PopAdd("x"))   # a residual around the Linear
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        declared(self, stash=[name], pop=[])

    def forward(self, x: Tensor) -> Tensor:
        stash(self.name, x)
        return x

    def extra_repr(self) -> str:
        return repr(self.name)


@skippable()
class PopCat(nn.Module):
    """Pop ``name`` and join it to the input along ``dim`` (channels by default), after the input.

    Where the input is smaller than the popped tensor in the dimensions after ``dim`` (an odd size
    halved and doubled again in a U-Net), the input is zero-padded at the end to match.
    """

    def __init__(self, name: str, dim: int = 1) -> None:
        super().__init__()
        self.name, self.dim = name, dim
        declared(self, stash=[], pop=[name])

    def forward(self, x: Tensor) -> Tensor:
        skip = pop(self.name)
        dim = self.dim % x.dim()
        missing = [s - t for s, t in zip(skip.shape[dim + 1 :], x.shape[dim + 1 :])]
        if any(missing):
            x = F.pad(x, [p for m in reversed(missing) for p in (0, m)])
        return torch.cat((x, skip), dim=dim)

    def extra_repr(self) -> str:
        return f"{self.name!r}, dim={self.dim}"


@skippable()
class PopAdd(nn.Module):
    """Pop ``name`` and add it to the input: the end of a residual connection."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        declared(self, stash=[], pop=[name])

    def forward(self, x: Tensor) -> Tensor:
        return x + pop(self.name)

    def extra_repr(self) -> str:
        return repr(self.name)
