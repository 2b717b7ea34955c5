"""A drain for ``torch.autograd.grad`` and ``backward(inputs=...)``: input gradients only, no ``.grad`` touched.

The drain normally runs each micro-batch's backward with ``torch.autograd.backward``, which adds the stage's
parameter gradients to their ``.grad`` in place, as the caller's ``loss.backward()`` does on one device. A
caller that asks for some gradients only (``torch.autograd.grad(loss, x)`` for a saliency map or an
adversarial example, ``backward(inputs=stem_params)``) must get those and leave every ``.grad`` alone: the
drain then back-propagates into the stage's inputs only, which is all the pipeline's autograd node returns.

The stage's parameters are not inputs of that node (their hooks would run with ``None`` on every whole
backward), so a call that names them (``torch.autograd.grad(loss, backbone_params)``) cannot reach them: torch
says they were "not used in the graph". ``docs/compatibility.md`` lists it as a known limit.

>>> import torch
>>> w = torch.ones(2, requires_grad=True)
>>> x = torch.ones(2, requires_grad=True)
>>> back_into_inputs([(x * w).sum()], [torch.ones(())], [x])
>>> x.grad.tolist(), w.grad
([1.0, 1.0], None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import Node

__all__ = ["back_into_inputs", "fills_every_leaf"]


def fills_every_leaf(anchor: Optional[Node]) -> bool:
    """Whether the backward under way fills every leaf's ``.grad`` (``backward()``), judged by ``anchor``.

    ``anchor`` is the gradient accumulator of a leaf made for the call, that only a whole backward reaches: a
    ``backward(inputs=...)`` or ``torch.autograd.grad`` runs only the nodes on the way to what it asked for (and
    torch refuses the question about a leaf inside some ``torch.autograd.grad`` calls, which ask for some
    gradients too). torch has no public way to ask which nodes the running backward will execute;
    ``_will_engine_execute_node`` is what torch's own multi-grad hooks ask. Without it, the drain fills ``.grad``.
    """
    ask = getattr(torch._C, "_will_engine_execute_node", None)
    if anchor is None or ask is None:
        return True
    try:
        return bool(ask(anchor))
    except RuntimeError:  # "... we are currently running autograd.grad()"
        return False


def back_into_inputs(outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]) -> None:
    """One micro-batch's backward into ``inputs``' ``.grad`` only (the drain sends those upstream); no
    parameter's ``.grad`` changes, and no hook on a parameter runs."""
    if inputs:
        torch.autograd.backward(list(outputs), list(grads), inputs=list(inputs))
