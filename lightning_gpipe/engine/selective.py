"""A drain for ``torch.autograd.grad`` and ``backward(inputs=...)``: gradients returned, not added to ``.grad``.

The drain normally runs each micro-batch's backward with ``torch.autograd.backward``, which adds the stage's
parameter gradients to their ``.grad`` in place, as the caller's ``loss.backward()`` would on one device. A
caller that asks for some gradients only (``torch.autograd.grad(out.sum(), x)`` for a saliency map,
``torch.autograd.grad(loss, params)``, ``loss.backward(inputs=generator_params)``) must get those and leave
every ``.grad`` alone: the bridge then passes this stage's parameters' gradients back through autograd, which
hands each one to whoever asked for it, and drops the rest.

>>> import torch
>>> w = torch.ones(2, requires_grad=True)
>>> x = torch.ones(2, requires_grad=True)
>>> drained = Drained([w])
>>> drained.backward([(x * w).sum()], [torch.ones(())], [x])
>>> x.grad.tolist(), drained.grads[0].tolist(), w.grad
([1.0, 1.0], [1.0, 1.0], None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import Node

__all__ = ["Drained", "fills_every_leaf"]


def fills_every_leaf(anchor: Optional[Node]) -> bool:
    """Whether the backward under way fills every leaf's ``.grad`` (``backward()``), judged by ``anchor``.

    ``anchor`` is the node of a tensor made for the call, that nothing but a whole backward reaches: a
    ``backward(inputs=...)`` or ``torch.autograd.grad`` runs only the nodes on the way to what it asked for.
    torch has no public way to ask which nodes the running backward will execute; ``_will_engine_execute_node``
    is what torch's own multi-grad hooks ask. Without it, the drain fills ``.grad`` as before.
    """
    ask = getattr(torch._C, "_will_engine_execute_node", None)
    if anchor is None or ask is None:
        return True
    try:
        return bool(ask(anchor))
    except RuntimeError:  # torch refuses the question for some nodes; the answer was "yes" before it existed
        return True


class Drained:
    """The parameter gradients of one selective drain, summed over its micro-batches in the drain's order."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.grads: list[Optional[Tensor]] = [None] * len(self.params)

    def backward(self, outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]) -> None:
        """One micro-batch: ``inputs``' gradients into their ``.grad`` (the drain sends those upstream), the
        parameters' into :attr:`grads`; no parameter's ``.grad`` changes."""
        wanted = [*inputs, *self.params]
        if not wanted:
            return
        found = torch.autograd.grad(list(outputs), wanted, list(grads), allow_unused=True)
        for leaf, grad in zip(inputs, found):
            if grad is not None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        for k, grad in enumerate(found[len(inputs) :]):
            if grad is not None:
                held = self.grads[k]
                self.grads[k] = grad if held is None else held + grad
