"""Declaring skips: ``@skippable(stash=..., pop=...)``, :func:`stash` and :func:`pop` inside a forward, namespaces.

The declaration is what lets a pipeline route every skip before the first batch, and check it: a pop
with no stash, a stash never popped, two stashes under one name and a pop before its stash are errors
at construction, not hangs at the first step. :func:`stash` and :func:`pop` refuse a name their
module did not declare, so the declaration cannot drift from the code.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional, TypeVar

from torch import Tensor, nn

from lightning_gpipe.engine.skip.keys import Namespace, SkipKey
from lightning_gpipe.engine.skip.tracker import current_tracker

__all__ = ["declared", "isolate", "pop", "skippable", "stash"]

M = TypeVar("M", bound=nn.Module)

_local = threading.local()  # the skippable modules whose forward is running, innermost last


def _names(kind: str, names: Iterable[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(f"`{kind}` takes a list of names, got the string {names!r}; write {kind}=[{names!r}].")
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"Skip names must be non-empty strings; `{kind}` has {name!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"`{kind}` names a skip twice: {list(names)}.")
    return names


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[M]], type[M]]:
    """Declare the skips an ``nn.Module`` class stashes and pops in its ``forward``.

    The class's ``forward`` may then call :func:`stash` with the names in ``stash`` and :func:`pop`
    with the names in ``pop``. A subclass that overrides ``forward`` is decorated again. Instances may
    narrow or set the names per object with :func:`declared` (how :class:`~.layers.Stash` takes a name).
    """
    stashes, pops = _names("stash", stash), _names("pop", pop)

    def decorate(cls: type[M]) -> type[M]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, got {cls!r}.")
        original = cls.forward

        @functools.wraps(original)
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            with _running(self):
                return original(self, *args, **kwargs)

        cls.forward = forward
        cls._skip_stash = stashes  # type: ignore[attr-defined]
        cls._skip_pop = pops  # type: ignore[attr-defined]
        return cls

    return decorate


def declared(module: nn.Module, stash: Optional[Iterable[str]] = None, pop: Optional[Iterable[str]] = None) -> None:
    """Set the names one skippable ``module`` stashes or pops (``None``: keep its class's)."""
    if not hasattr(type(module), "_skip_stash"):
        raise TypeError(f"{type(module).__name__} is not @skippable, so it cannot declare skips.")
    if stash is not None:
        module._skip_stash = _names("stash", stash)  # type: ignore[assignment]
    if pop is not None:
        module._skip_pop = _names("pop", pop)  # type: ignore[assignment]


def skip_names(module: nn.Module) -> Optional[tuple[tuple[SkipKey, ...], tuple[SkipKey, ...]]]:
    """The keys ``module`` stashes and pops, or ``None`` if it is not skippable."""
    if not hasattr(module, "_skip_stash"):
        return None
    spaces = namespaces_of(module)
    return (
        tuple((spaces, name) for name in module._skip_stash),  # type: ignore[union-attr]
        tuple((spaces, name) for name in module._skip_pop),  # type: ignore[union-attr]
    )


def namespaces_of(module: nn.Module) -> tuple[Namespace, ...]:
    return getattr(module, "_skip_namespaces", ())


def isolate(module: M, namespace: Optional[Namespace] = None) -> M:
    """Put every skippable module inside ``module`` into ``namespace`` (a new one by default); returns ``module``.

    A name stashed inside then pairs only with a pop inside the same namespace, so a block type that
    stashes ``"skip"`` can be used many times: ``isolate(Block())`` for each use. Namespaces nest: a
    block isolated inside a model that is isolated again keeps its pairs apart.
    """
    namespace = namespace if namespace is not None else Namespace()
    for sub in module.modules():
        if hasattr(sub, "_skip_stash"):
            sub._skip_namespaces = (namespace, *namespaces_of(sub))  # type: ignore[assignment]
    return module


@contextmanager
def _running(module: nn.Module) -> Iterator[None]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(module)
    try:
        yield
    finally:
        stack.pop()


def _current(verb: str, name: str) -> nn.Module:
    stack = getattr(_local, "stack", None)
    if not stack:
        raise RuntimeError(
            f"{verb}({name!r}) was called outside the forward of a @skippable module. Call it in the forward of "
            f"a module class decorated with @skippable({verb}=[{name!r}])."
        )
    module = stack[-1]
    names = module._skip_stash if verb == "stash" else module._skip_pop
    if name not in names:
        raise LookupError(
            f"{type(module).__name__}.forward calls {verb}({name!r}), but it declares {verb}={list(names)}. Add "
            f"{name!r} to its @skippable({verb}=[...]): the pipeline routes only declared skips."
        )
    return module


def stash(name: str, tensor: Tensor) -> None:
    """Keep ``tensor`` under ``name`` for the layer that pops it (call inside a ``@skippable`` forward)."""
    module = _current("stash", name)
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{type(module).__name__} stashes {name!r} as a {type(tensor).__name__}; stash a Tensor.")
    current_tracker().stash((namespaces_of(module), name), tensor, module)


def pop(name: str) -> Tensor:
    """The tensor stashed under ``name`` by an earlier layer (call inside a ``@skippable`` forward)."""
    module = _current("pop", name)
    return current_tracker().pop((namespaces_of(module), name), module)
