"""Optimizers over one stage's share of the model: a share with nothing to train, and steps that need all of it.

Each stage builds its optimizer from the same code (``Adam(self.parameters())``) over the parameters it
holds. Two things differ from one device:

- A stage can hold none of the parameters an optimizer is given (a frozen feature extractor, an
  optimizer over a few layers that all sit on other stages). torch refuses to build an optimizer from
  an empty list, but the stage still has to run the same optimizer loop as the others, a no-op for it.
  :func:`accept_empty_parameter_lists` lets torch build it: one param group with no parameters and the
  optimizer's defaults, which is what the one-device optimizer's single group is on this stage. No
  placeholder parameter is involved, so nothing extra reaches a checkpoint, a scheduler or a callback.
- An optimizer whose step is computed from the whole gradient at once (:func:`needs_whole_gradient`)
  would see only this stage's part of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["WHOLE_GRADIENT", "accept_empty_parameter_lists", "needs_whole_gradient"]

_INIT = "__init__"  # replaced with setattr: mypy refuses a plain assignment to a method

#: Optimizers (and their subclasses) whose step uses quantities of the whole gradient, not of each parameter
#: alone. LBFGS takes dot products and norms of the flattened gradient over all parameters (its curvature
#: pairs, its step size, its stopping tests and its line search). The others in ``torch.optim`` (SGD, Adam,
#: AdamW, Adamax, NAdam, RAdam, RMSprop, Rprop, Adagrad, Adadelta, ASGD, Adafactor, Muon, SparseAdam) update
#: each parameter from its own gradient and state, so a stage steps its parameters exactly as one device does.
WHOLE_GRADIENT: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)


@contextmanager
def accept_empty_parameter_lists() -> Iterator[list[Optimizer]]:
    """While open, ``SomeOptimizer(params)`` with an empty ``params`` builds an optimizer with one empty group.

    Yields the list of the optimizers built that way, so that the caller can tell an optimizer that is empty
    on every stage (which one device refuses too) from one that is empty here only. torch raises
    ``ValueError: optimizer got an empty parameter list`` only for an empty iterable: a list of param groups
    whose ``params`` are empty is accepted, and stepping, clipping, schedulers and ``state_dict`` all handle
    such groups. So the substitute is the group torch would have made from a flat list of this stage's
    parameters, holding none of them. Patches ``torch.optim.Optimizer.__init__``, which every optimizer calls.

    ``meta`` parameters (another stage's layers, reached by position through ``GPipe.all_layers``) are dropped
    first, from a flat list and from each group, which stays (empty where it held only those): every stage keeps
    the same groups, as the checkpoints' and the lock-step checks' mapping of groups to stages expects.
    """
    original = Optimizer.__init__
    emptied: list[Optimizer] = []

    def __init__(self: Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        if isinstance(params, torch.Tensor):  # torch's own TypeError
            return original(self, params, defaults)
        params = [_local(p) for p in params]
        params = [p for p in params if p is not None]
        if params:
            return original(self, params, defaults)
        original(self, [{"params": []}], defaults)
        emptied.append(self)

    setattr(Optimizer, _INIT, __init__)
    try:
        yield emptied
    finally:
        setattr(Optimizer, _INIT, original)


def _local(entry: Any) -> Any:
    """A parameter (or a ``(name, parameter)`` pair) or a param group without the ``meta`` parameters: another
    stage's, which the code that builds the optimizers may reach through ``GPipe.all_layers``. ``None`` for a
    ``meta`` parameter."""
    if isinstance(entry, dict) and "params" in entry:
        params = entry["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        return {**entry, "params": [p for p in params if not _is_meta(p)]}
    return None if _is_meta(entry) else entry


def _is_meta(entry: Any) -> bool:
    value = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry
    return isinstance(value, torch.Tensor) and value.is_meta


def needs_whole_gradient(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s step depends on the gradient of every parameter at once (see :data:`WHOLE_GRADIENT`)."""
    return isinstance(optimizer, WHOLE_GRADIENT)
