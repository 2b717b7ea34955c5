"""The engine's tracing hook: the :class:`Tracer` protocol that ``GPipe.tracer`` takes, and the span that calls it.

The engine reports where each pass of its stage starts and stops, and does nothing else with the
times; :class:`lightning_gpipe.StageTimer` (in :mod:`lightning_gpipe.monitor.timer`) is the
implementation this package ships. The protocol lives here, with the engine, so that the engine
depends on nothing above it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Protocol

__all__ = ["Tracer", "span"]


class Tracer(Protocol):
    """What ``StageRunner.tracer`` must be: told where each pass of the stage starts and stops.

    ``start(kind)`` runs right before the pass and returns a token (a clock stamp, a CUDA event)
    that ``stop(kind, micro, token)`` gets right after it. Kinds: ``"forward"``, ``"recompute"``,
    ``"backward"`` (one micro-batch's compute); ``"wait"`` (blocked on a message, or on the delivery
    of sends); ``"fill"`` and ``"drain"`` (one call's whole forward and backward). ``micro`` is -1
    where no micro-batch applies (the shared output, the input gradient, fill, drain, flushes).
    """

    def start(self, kind: str) -> Any: ...

    def stop(self, kind: str, micro: int, token: Any) -> None: ...


class _Span:
    __slots__ = ("tracer", "kind", "micro", "token")

    def __init__(self, tracer: Tracer, kind: str, micro: int) -> None:
        self.tracer, self.kind, self.micro = tracer, kind, micro

    def __enter__(self) -> None:
        self.token = self.tracer.start(self.kind)

    def __exit__(self, *exc: object) -> None:
        self.tracer.stop(self.kind, self.micro, self.token)


_UNTRACED = nullcontext()  # reusable, so an untraced pass costs one attribute check and a no-op `with`


def span(tracer: Optional[Tracer], kind: str, micro: int = -1) -> AbstractContextManager[None]:
    """A ``with`` block that reports one pass to ``tracer``; a no-op when it is ``None``."""
    return _UNTRACED if tracer is None else _Span(tracer, kind, micro)
