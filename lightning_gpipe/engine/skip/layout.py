"""Where each skip of a Sequential goes: from the layer (and stage) of its stash to the layer (and stage) of its pop.

:func:`find_skips` reads the declarations of every layer and checks them when a pipeline is built,
so that a wrong model fails with an error naming the layers, not with a hang at the first step.
:class:`SkipRoutes` places each skip on the stages of a split: what a stage sends, to which stage,
and what it receives, always in one order that every process computes alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_gpipe.engine.skip.declare import skip_names
from lightning_gpipe.engine.skip.keys import SkipKey

__all__ = ["Route", "SkipRoutes", "find_skips"]


@dataclass(frozen=True)
class Route:
    """One skip: stashed in layer ``stash_layer``, popped in layer ``pop_layer`` (indices in the Sequential)."""

    key: SkipKey
    stash_layer: int
    pop_layer: int

    @property
    def name(self) -> str:
        return self.key[1]

    def order(self) -> tuple[int, int, str]:
        """The same on every process (namespaces are not: each process makes its own)."""
        return (self.stash_layer, self.pop_layer, self.name)


def _where(module: nn.Sequential, index: int) -> str:
    return f"layer {index} ({type(module[index]).__name__})"


def _label(key: SkipKey) -> str:
    return f"{key[1]!r}" + (" (isolated)" if key[0] else "")


def find_skips(module: nn.Sequential) -> list[Route]:
    """Every skip of ``module``, in a fixed order; raises ``ValueError`` naming the layers of a wrong one.

    A layer's skips are those its skippable submodules declare (a block may hold its Stash deep
    inside). Refused: a pop with no stash, a stash never popped, two stashes or two pops under one
    name, and a pop in a layer before its stash's. Stash and pop in one layer are that layer's own
    business: it runs whole on one stage.
    """
    stashes: dict[SkipKey, int] = {}
    pops: dict[SkipKey, int] = {}
    for index, layer in enumerate(module):
        for sub in layer.modules():
            names = skip_names(sub)
            if names is None:
                continue
            for found, kind, keys in ((stashes, "stashes", names[0]), (pops, "pops", names[1])):
                for key in keys:
                    if key in found:
                        raise ValueError(
                            f"Two {kind} of the skip {_label(key)}: {_where(module, found[key])} and "
                            f"{_where(module, index)}. A name is stashed once and popped once per forward. When one "
                            "block is used several times, isolate each use: `lightning_gpipe.isolate(block)`; when "
                            "several layers need one tensor, the layer that pops it stashes it again under a new name."
                        )
                    found[key] = index
    for key, index in pops.items():
        if key not in stashes:
            raise ValueError(
                f"{_where(module, index)} pops the skip {_label(key)}, but no layer of the backbone stashes it. Stash "
                "it in an earlier layer (within the same namespace), or remove the pop."
            )
    routes = []
    for key, index in stashes.items():
        if key not in pops:
            raise ValueError(
                f"{_where(module, index)} stashes the skip {_label(key)}, but no layer of the backbone pops it. Every "
                "stashed tensor must be popped by a later layer; remove the stash or add the pop."
            )
        if pops[key] < index:
            raise ValueError(
                f"{_where(module, pops[key])} pops the skip {_label(key)} before {_where(module, index)} stashes it. "
                "A pop must come in the same layer as its stash or a later one."
            )
        routes.append(Route(key, index, pops[key]))
    return sorted(routes, key=Route.order)


class SkipRoutes:
    """The skips of a Sequential placed on the stages of ``balance``: who sends what to whom, in a fixed order.

    A skip whose stash and pop land on one stage stays inside it. Every other skip is a message from
    the stash's stage straight to the pop's stage for each micro-batch (and its gradient back),
    bundled per pair of stages.

    >>> routes = SkipRoutes([Route(((), "x"), 0, 3)], balance=[2, 1, 1])
    >>> routes.pairs(), list(routes.leaving(0)), list(routes.arriving(2))
    ({(0, 2)}, [2], [0])
    """

    def __init__(self, routes: Sequence[Route], balance: Sequence[int]) -> None:
        starts = [sum(balance[:s]) for s in range(len(balance))]

        def stage_of(layer: int) -> int:
            return max(s for s, start in enumerate(starts) if start <= layer)

        self.routes = sorted(routes, key=Route.order)
        self._ends = [(stage_of(r.stash_layer), stage_of(r.pop_layer)) for r in self.routes]

    def pairs(self) -> set[tuple[int, int]]:
        """The (stash stage, pop stage) pairs that exchange skips."""
        return {(a, b) for a, b in self._ends if a != b}

    def leaving(self, stage: int) -> dict[int, list[Route]]:
        """The skips ``stage`` stashes for later stages, by the stage of their pop, in the fixed order."""
        return self._crossing(stage, end=0)

    def arriving(self, stage: int) -> dict[int, list[Route]]:
        """The skips ``stage`` pops from earlier stages, by the stage of their stash, in the fixed order."""
        return self._crossing(stage, end=1)

    def _crossing(self, stage: int, end: int) -> dict[int, list[Route]]:
        """The cross-stage skips whose stash (``end=0``) or pop (``end=1``) is on ``stage``, by the other stage."""
        out: dict[int, list[Route]] = {}
        for route, ends in zip(self.routes, self._ends):
            if ends[end] == stage != ends[1 - end]:
                out.setdefault(ends[1 - end], []).append(route)
        return dict(sorted(out.items()))
