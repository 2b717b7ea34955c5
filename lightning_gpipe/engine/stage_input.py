"""A stage's input as its layers see it: an in-place first layer works on it, and a recompute starts from it unchanged.

Each micro-batch enters a stage as a leaf (received from the previous stage, or cut from the batch on the
first stage); the drain reads the leaf's ``.grad`` and sends it upstream. torch refuses an in-place op on a
leaf that requires grad, and ``nn.ReLU(inplace=True)`` as a stage's first layer is common: a split between
a convolution and its activation (torchvision's VGG ``features``, AlexNet). On one device that ReLU gets the
convolution's output, which is no leaf, and works. So :func:`enter` hands the layers an identity of the
leaf that autograd does not count as a leaf or a view: the same memory, no copy, the gradient passed on
unchanged.

On the first stage the micro-batches are views of one batch tensor, and views share their base's version
counter: micro-batch 1's in-place write would then invalidate what micro-batch 0's graph saved of its own
slice, an error one device (one batch, one write) never meets. So :class:`FirstStageInputs` makes each
micro-batch's leaf an alias of its slice with a version counter of its own, and passes a write through the
alias on to the slice's counter after the forward: a graph outside the pipeline that saved the batch (a stem
before the backbone) then fails its backward as it does on one device, instead of using the written values.

A checkpointed micro-batch's forward runs without a graph, and the drain runs the layers again on the
input stored from that forward. A layer that writes its input in place (a ReLU, ``nn.Dropout(inplace=True)``,
``x += ...``) would leave the recompute starting from the written values: a ReLU comes out the same, but a
dropout is applied twice, silently. :class:`KeptInputs` watches the inputs' version counters in the first
checkpointed forward, which runs on a copy; a stage that wrote its input keeps running them on copies.
``torch.utils.checkpoint`` has no such guard (it is the user's own choice of function there); here the
recompute is the pipeline's, so keeping it exact is the pipeline's job.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.skip.traffic import Bundles

__all__ = ["FirstStageInputs", "KeptInputs", "enter"]


class _Entry(torch.autograd.Function):
    """The identity, as a graph node: its output shares the leaf's memory but is neither a leaf nor a view,
    so an in-place op on it is allowed (autograd rebases it), and the gradient reaches the leaf as it was."""

    @staticmethod
    def forward(ctx: Any, leaf: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        return leaf.detach()  # a new tensor object on the same memory: not the input, so not made a view

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor]) -> Optional[Tensor]:
        return grad


def _enter_tensor(t: Tensor) -> Tensor:
    return _Entry.apply(t) if t.requires_grad else t


def enter(x: Any) -> Any:
    """``x`` (a micro-batch input, a bundle of skips) as a stage's layers get it.

    With a graph being built, every tensor that requires grad goes through :class:`_Entry` (about 2 us
    each on a CPU here); without one, in-place ops on leaves are allowed, and nothing changes.
    """
    return microbatch.map_tensors(_enter_tensor, x) if torch.is_grad_enabled() else x


class KeptInputs:
    """Keeps a checkpointed micro-batch's stored input as it came, for the recompute.

    ``writes`` is ``None`` until the first checkpointed forward, which runs on a copy and shows through
    the copy's version counters whether the stage writes its input in place. ``True``: every checkpointed
    forward runs on a copy (one input's bytes, for the forward's duration). ``False``: on the stored input
    itself, and a version that moves later (an in-place op that depends on the data) ends the call with an
    error, since the stored input is no longer what the recompute needs.
    """

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.writes: Optional[bool] = None

    def for_forward(self, x: Any, received: Bundles) -> tuple[Any, Bundles, list[tuple[Tensor, int]]]:
        """The input and skips for a checkpointed forward, and the tensors to watch (with their versions)."""
        if self.writes is not False:
            x = microbatch.map_tensors(torch.clone, x)
            received = {src: tuple(t.clone() for t in bundle) for src, bundle in received.items()}
        watched = [*microbatch.tensors(x), *(t for bundle in received.values() for t in bundle)]
        return x, received, [(t, t._version) for t in watched]

    def after_forward(self, watched: list[tuple[Tensor, int]], micro: int) -> None:
        """Learn from the first checkpointed forward; refuse a write where the stored input was used."""
        written = any(t._version != version for t, version in watched)
        if self.writes is None:
            self.writes = written
        elif written and not self.writes:
            raise RuntimeError(
                f"Stage {self.stage}'s layers wrote their input in place in the forward of checkpointed micro-batch "
                f"{micro} (an in-place op on the stage's first tensor: `nn.ReLU(inplace=True)`, "
                "`nn.Dropout(inplace=True)`, `x += ...`), which they had not done in the stage's first checkpointed "
                "forward, so the pipeline had stopped copying the input for them. The stored input the recompute "
                "would start from has changed. Make that op out of place, or use checkpoint='never'."
            )


def _alias(t: Tensor) -> Tensor:
    """A leaf on ``t``'s memory with a version counter of its own (``detach()`` would share ``t``'s), of ``t``'s class.

    A layout other than strided (sparse), or a tensor without storage of its own (a wrapper subclass), keeps
    ``detach()``: it has no plain storage to alias.
    """
    try:
        storage = t.untyped_storage() if t.layout == torch.strided else None
    except (RuntimeError, NotImplementedError):
        storage = None
    if storage is None:
        return t.detach().requires_grad_(t.requires_grad)
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    alias.set_(storage, t.storage_offset(), t.size(), t.stride())
    if type(t) is not Tensor:
        alias = alias.as_subclass(type(t))
    return alias.requires_grad_(t.requires_grad)


class FirstStageInputs:
    """One training call's micro-batch leaves on the first stage, and the batch slices they alias."""

    def __init__(self) -> None:
        self._pairs: list[list[tuple[Tensor, Tensor, int]]] = []  # per micro-batch: (leaf, slice, leaf's version)

    def leaves(self, micro_input: Any) -> Any:
        """``micro_input`` (slices of the batch) as leaves; the next micro-batch's, in order."""
        x = microbatch.map_tensors(_alias, micro_input)
        pairs = zip(microbatch.tensors(x), microbatch.tensors(micro_input))
        self._pairs.append([(leaf, original, leaf._version) for leaf, original in pairs])
        return x

    def pass_on_writes(self, micro: int) -> None:
        """After a forward or a recompute of ``micro``: a leaf written in place marks its slice written too."""
        pairs = self._pairs[micro]
        for k, (leaf, original, version) in enumerate(pairs):
            if leaf._version != version:
                torch.autograd.graph.increment_version(original)
                pairs[k] = (leaf, original, leaf._version)
