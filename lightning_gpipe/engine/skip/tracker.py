"""Where stashed tensors wait for their pops: one tracker per micro-batch in a pipeline, one per thread otherwise."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Optional

import torch  # noqa: F401 (the doctest)
from torch import Tensor, nn

from lightning_gpipe.engine.skip.keys import SkipKey

__all__ = ["SkipTracker", "current_tracker", "use_tracker"]

_local = threading.local()


def _describe(key: SkipKey) -> str:
    spaces, name = key
    return f"{name!r}" + (f" (in namespace {', '.join(map(repr, spaces))})" if spaces else "")


class SkipTracker:
    """The skip tensors of one pass: stashes wait here until popped.

    The engine runs each micro-batch of a stage with a tracker of its own that holds the tensors other
    stages sent (``received``) and records every stash (``stashed``), which it then sends to the stages
    of their pops. Outside a pipeline (a plain forward on one device) a per-thread tracker pairs each
    stash with the next pop of its name.

    >>> tracker = SkipTracker()
    >>> tracker.stash(((), "x"), torch.ones(1), nn.Identity())
    >>> tracker.pop(((), "x"), nn.Identity())
    tensor([1.])
    """

    def __init__(self, received: Optional[Mapping[SkipKey, Tensor]] = None, record: bool = False) -> None:
        self._waiting: dict[SkipKey, Tensor] = dict(received or {})
        self.stashed: dict[SkipKey, Tensor] = {}
        self._record = record

    def stash(self, key: SkipKey, tensor: Tensor, module: nn.Module) -> None:
        # A stash replaces one that was never popped: outside a pipeline, a forward that failed half-way
        # leaves one behind, and the next forward must not see it.
        self._waiting[key] = tensor
        if self._record:
            if key in self.stashed:
                raise RuntimeError(
                    f"{type(module).__name__} stashed {_describe(key)} a second time in one micro-batch; a stash "
                    "name holds one tensor per pass. Isolate each use of the block: `isolate(block)`."
                )
            self.stashed[key] = tensor

    def pop(self, key: SkipKey, module: nn.Module) -> Tensor:
        try:
            return self._waiting.pop(key)
        except KeyError:
            raise LookupError(
                f"{type(module).__name__} pops {_describe(key)}, but nothing is stashed under it in this pass: the "
                "layer that stashes it must run earlier in the same forward, and each stash is popped once."
            ) from None


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Stashes and pops inside the block go to ``tracker``."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous


def current_tracker() -> SkipTracker:
    """The tracker in use: the engine's for the running micro-batch, or this thread's default one."""
    tracker = getattr(_local, "tracker", None)
    if tracker is None:
        default = getattr(_local, "default", None)
        if default is None:
            default = _local.default = SkipTracker()
        return default
    return tracker
