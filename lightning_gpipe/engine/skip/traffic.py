"""One stage's skip traffic: the skips it receives from earlier stages and sends to later ones, per micro-batch.

The stage runner calls it around each micro-batch: :meth:`StageSkips.receive` before the layers run
(one message from each stage that stashes for this one), :meth:`StageSkips.outgoing` after (one bundle
for each stage that pops from this one). The gradients go back the same pairs in the drain. Each
bundle lists its tensors in the routes' fixed order, the same on every process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Optional

from torch import Tensor

from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.messages import Message
from lightning_gpipe.engine.skip.keys import SkipKey
from lightning_gpipe.engine.skip.layout import SkipRoutes
from lightning_gpipe.engine.skip.tracker import SkipTracker

__all__ = ["Bundles", "StageSkips"]

#: Skip tensors of one micro-batch by the other stage (source or destination), in the routes' order.
Bundles = dict[int, tuple[Tensor, ...]]


class StageSkips:
    """The skips of stage ``stage`` that cross to or from other stages (none: every method is a no-op)."""

    def __init__(self, routes: Optional[SkipRoutes] = None, stage: int = 0) -> None:
        self.leaving = routes.leaving(stage) if routes is not None else {}
        self.arriving = routes.arriving(stage) if routes is not None else {}

    def receive(self, recv: Callable[[int], Message], train: bool) -> tuple[Bundles, dict[int, bool]]:
        """The skips stashed for this stage, by source stage, and whether each source waits for their gradient.

        ``recv(source stage)`` takes the next skip message from that stage. In training, a tensor the
        sender flags gets ``requires_grad``: its ``.grad`` after the backward is what goes back.
        """
        bundles: Bundles = {}
        wants: dict[int, bool] = {}
        for src, routes in self.arriving.items():
            message = recv(src)
            values = message.tensors()
            if len(values) != len(routes):
                raise PipelineError(
                    f"{message.tag.describe()} from stage {src} carried {len(values)} skip tensors, but "
                    f"{len(routes)} skips ({[r.name for r in routes]}) go from that stage to this one: the stages were "
                    "built from different models."
                )
            flags = message.requires_grad
            bundles[src] = tuple(v.requires_grad_() if train and f else v for v, f in zip(values, flags))
            wants[src] = train and any(flags)
        return bundles, wants

    def keyed(self, bundles: Mapping[int, tuple[Tensor, ...]]) -> dict[SkipKey, Tensor]:
        """The received tensors by skip key, for the stage's tracker."""
        return {route.key: t for src, values in bundles.items() for route, t in zip(self.arriving[src], values)}

    def outgoing(self, tracker: SkipTracker, describe_layer: Callable[[int], str]) -> Bundles:
        """What the micro-batch stashed for later stages, by destination stage."""
        bundles: Bundles = {}
        for dst, routes in self.leaving.items():
            for route in routes:
                if route.key not in tracker.stashed:
                    raise RuntimeError(
                        f"{describe_layer(route.stash_layer)} declares the skip {route.name!r}, which layer "
                        f"{route.pop_layer} on stage {dst} pops, but its forward did not stash it. A declared stash "
                        "must happen in every forward: the stage of the pop waits for it."
                    )
            bundles[dst] = tuple(tracker.stashed[route.key] for route in routes)
        return bundles

    @staticmethod
    def input_grads(bundles: Mapping[int, tuple[Tensor, ...]], src: int) -> tuple[Optional[Tensor], ...]:
        """The gradients of the skips received from ``src`` after the backward: ``None`` where a skip got none (the
        stash's stage then back-propagates nothing for it, as one device would)."""
        return tuple(t.grad if t.requires_grad else None for t in bundles[src])
