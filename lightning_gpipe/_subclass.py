"""Copies of objects as a subclass that adds behaviour: how the package changes objects it did not create.

Lightning creates some of the objects a pipeline must change, and offers no hook to pass another
class: the precision plugin (from ``precision=``), whose norm clipping must use the norm over every
stage, and its own ``ModelSummary`` callback, which must count every stage. The training DataLoader
is the user's, of any DataLoader subclass, and must become resumable mid-epoch. For each, this makes
a shallow copy whose class derives from both a small mixin and the object's own class, so every
setting and override of the original stays, and the original object is left untouched (the
package never assigns ``__class__`` on an object it was given).
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

__all__ = ["copy_as"]

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def _subclass(mixin: type, base: Any) -> Any:
    cls = type(f"{mixin.__name__.lstrip('_')}{base.__name__}", (mixin, base), {})
    # the original's qualified name, under which Lightning keys state in checkpoints (the precision plugin's entry,
    # a callback's state key), so that a pipeline's checkpoint and one device's use the same keys
    cls.__qualname__ = base.__qualname__
    cls.__module__ = mixin.__module__
    return cls


def copy_as(obj: T, mixin: type) -> T:
    """A shallow copy of ``obj`` whose class is ``mixin`` on top of ``type(obj)`` (``obj`` itself if it has it).

    The copy shares the original's attribute values (not its ``__init__``: nothing is run again).

    >>> class Loud:
    ...     def hello(self): return super().hello().upper()
    >>> class Greeter:
    ...     def __init__(self, name): self.name = name
    ...     def hello(self): return f"hello {self.name}"
    >>> original = Greeter("you")
    >>> copy_as(original, Loud).hello(), original.hello()
    ('HELLO YOU', 'hello you')
    """
    if isinstance(obj, mixin):
        return obj
    base: Any = type(obj)
    cls: type[T] = _subclass(mixin, base)
    new: T = object.__new__(cls)
    new.__dict__.update(obj.__dict__)
    return new
