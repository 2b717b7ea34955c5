"""What names a skip: the namespaces of its module and its name (:data:`SkipKey`)."""

from __future__ import annotations

import uuid

__all__ = ["Namespace", "SkipKey"]


class Namespace:
    """A scope for skip names, so that one block type can be used many times (see :func:`isolate`).

    Equal namespaces are the same scope; a deep copy or a pickle of a model keeps its namespaces equal
    to the original's (they compare by a random id, not by object).

    >>> Namespace() == Namespace()
    False
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<Namespace {self.id[:8]}>"

    def __getstate__(self) -> str:
        return self.id

    def __setstate__(self, state: str) -> None:
        self.id = state


#: What a skip is called in one process: the namespaces of its module (outermost first) and its name.
SkipKey = tuple[tuple[Namespace, ...], str]
