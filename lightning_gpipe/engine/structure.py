"""What crosses a stage boundary: a stage output as its tensors and a :class:`Structure` that rebuilds it; pure.

A Tensor or a flat tuple of tensors, what most layers return, takes a flag. Anything else, tensors nested in
tuples, lists, dicts, namedtuples and dataclasses with constants beside them, travels as a :class:`Skeleton`: the
output pickled with a placeholder for each tensor, small enough for a message header.

Written here rather than with ``torch.utils._pytree``: that module is private, its flat leaves mix the
constants in with the tensors, and its serialized ``TreeSpec`` (``treespec_dumps``) refuses a namedtuple that
was not registered for it (measured, torch 2.14), where a user's layer may return any namedtuple.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_gpipe.engine.microbatch import is_container, leaves, map_leaves, map_tensors, tensors

__all__ = ["SLOT", "Skeleton", "Structure", "crosses", "flatten", "per_sample", "unflatten"]


class _Slot:
    """Where a tensor was in a :class:`Skeleton`: one module-level instance, pickled by its name."""

    def __reduce__(self) -> str:
        return "SLOT"

    def __repr__(self) -> str:
        return "SLOT"


SLOT = _Slot()
#: Values that may sit beside the tensors of a stage output (a flag, a count, a ``None`` for an absent mask).
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


@dataclass(frozen=True)
class Skeleton:
    """A stage output of any other form than a Tensor or a flat tuple of them, with its tensors taken out.

    ``raw`` is the output pickled with :data:`SLOT` in place of each tensor, so a message header carries it
    to the next stage (an LSTM's ``(output, (h, c))``, a dict, a ``(hidden, None)`` pair, a namedtuple).

    >>> values, structure = flatten({"h": torch.zeros(2), "mask": None})
    >>> structure.fill(values)
    {'h': tensor([0., 0.]), 'mask': None}
    """

    raw: bytes

    def constants(self) -> list[Any]:
        """The values beside the tensors (``None``, numbers, strings), in order."""
        return leaves(pickle.loads(self.raw), lambda value: value is not SLOT and not is_container(value))

    def fill(self, values: Sequence[Tensor]) -> Any:
        """The output with ``values`` in place of its tensors, in the order of :func:`tensors`."""
        leaves = iter(values)
        return map_leaves(lambda _: next(leaves), pickle.loads(self.raw), lambda value: value is SLOT)


#: How a stage output is rebuilt from its tensors: ``False`` one tensor, ``True`` a flat tuple, else a Skeleton.
Structure = Union[bool, Skeleton]


def _odd_leaf(value: Any) -> Optional[str]:
    """The type name of the first leaf of ``value`` that is neither a tensor nor a constant, or ``None``."""
    odd = leaves(value, lambda leaf: not isinstance(leaf, (Tensor, *_CONSTANTS)) and not is_container(leaf))
    return type(odd[0]).__name__ if odd else None


def flatten(outputs: Any) -> tuple[tuple[Tensor, ...], Structure]:
    """A stage output as its tensors and how to rebuild it (:func:`unflatten`); ``TypeError`` where it cannot travel.

    A Tensor and a flat tuple of tensors, the common outputs, take a flag; anything else, tensors nested in tuples,
    lists and dicts with constants beside them (``None``, numbers, strings), a :class:`Skeleton`. Other objects
    are refused: their tensors could not be found, and their state could not be sent.

    >>> values, structure = flatten((torch.zeros(1), (torch.ones(1), None)))
    >>> len(values), unflatten(values, structure)
    (2, (tensor([0.]), (tensor([1.]), None)))
    """
    if isinstance(outputs, Tensor):
        return (outputs,), False
    if type(outputs) is tuple and outputs and all(isinstance(t, Tensor) for t in outputs):
        return outputs, True
    odd, leaves = _odd_leaf(outputs), tensors(outputs)
    if odd is not None or not leaves:
        kind = type(outputs).__name__
        what = kind if odd == kind else f"{kind} holding a {odd}" if odd else f"{kind} without a tensor"
        raise TypeError(
            f"got a {what}; a stage must return Tensors, or tuples, lists, dicts or dataclasses of them (None, numbers "
            "and strings may sit beside them)"
        )
    try:
        raw = pickle.dumps(map_tensors(lambda t: SLOT, outputs))
    except Exception as error:  # a namedtuple class defined inside a function cannot be named on another stage
        raise TypeError(f"got a {type(outputs).__name__} that cannot be pickled ({error})") from None
    return tuple(leaves), Skeleton(raw)


def unflatten(values: Sequence[Tensor], structure: Structure) -> Any:
    """Undo :func:`flatten`."""
    if isinstance(structure, Skeleton):
        return structure.fill(values)
    return tuple(values) if structure else values[0]


def per_sample(t: Tensor, size: int) -> bool:
    """Whether ``t`` has a micro-batch of ``size`` samples in dim 0: what the pipeline cuts and joins along."""
    return t.dim() > 0 and t.shape[0] == size


def crosses(outputs: Any, size: int) -> bool:
    """Whether a layer's output for a micro-batch of ``size`` samples can leave a stage: :func:`flatten` takes it,
    and each of its tensors has the samples in dim 0 (the stage's batch check).

    An automatic split keeps a layer whose output cannot on one stage with the next layer.

    >>> crosses((torch.zeros(4, 2), (torch.zeros(4), None)), 4)
    True
    >>> crosses(torch.zeros(3, 4, 2), 4)  # sequence first: the samples are in dim 1
    False
    """
    try:
        values, _ = flatten(outputs)
    except TypeError:
        return False
    return all(per_sample(t, size) for t in values)
