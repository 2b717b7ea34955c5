"""Re-materialization (GPipe's checkpointing): which micro-batches drop their activations, and the recompute.

A checkpointed micro-batch keeps only its stage input in the forward and runs the stage again right
before its backward. This module decides which micro-batches that is (``checkpoint=`` of ``GPipe``
and ``GPipeStrategy``: torchgpipe's three modes by name, or ``"keep:N"``, checkpointing by count) and
provides the context the recompute runs in. As in torchgpipe, the word
"checkpoint" means this everywhere in the package; files are in :mod:`lightning_gpipe.checkpointing`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.forward_attributes import AttributeWrites
from lightning_gpipe.engine.rng import layer_generators

__all__ = [
    "CHECKPOINT_MODES",
    "ForwardWrites",
    "Written",
    "check_checkpoint_mode",
    "checkpointed",
    "kept_count",
    "keep",
    "is_recomputing",
    "recomputing",
    "restore_buffer",
]

#: The re-materialization policies of torchgpipe, by name.
CHECKPOINT_MODES = ("always", "except_last", "never")

#: The prefix of checkpointing by count: ``"keep:N"`` keeps the activations of the last ``N`` micro-batches.
KEEP = "keep:"

_local = threading.local()

#: What a checkpointed micro-batch's forward wrote, as :meth:`ForwardWrites.before` keeps it for the recompute.
Written = dict[Any, Any]


def keep(count: int) -> str:
    """The checkpoint mode that keeps the activations of the last ``count`` micro-batches and recomputes the rest.

    The count is written into a string (``"keep:3"``), not passed as an int, so that a mode is always one
    type: it travels through a LightningCLI YAML file, a checkpoint's hyper-parameters and a log unchanged,
    and it says what the number means. ``keep:0`` is ``always``, ``keep:1`` is ``except_last``, a count of at
    least the number of micro-batches is ``never``.

    >>> keep(3)
    'keep:3'
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"`keep` takes a number of micro-batches (an int >= 0), got {count!r}.")
    return f"{KEEP}{count}"


def kept_count(mode: str) -> int | None:
    """The ``N`` of ``"keep:N"``, or ``None`` for a mode by name.

    >>> kept_count("keep:2"), kept_count("never")
    (2, None)
    """
    if not mode.startswith(KEEP):
        return None
    digits = mode[len(KEEP) :]
    return int(digits) if digits.isdigit() else None


def check_checkpoint_mode(mode: object) -> str:
    """``mode`` if it names a policy, else a ``ValueError`` that lists them."""
    if isinstance(mode, str) and (mode in CHECKPOINT_MODES or kept_count(mode) is not None):
        return mode
    raise ValueError(
        f"`checkpoint` must be one of {CHECKPOINT_MODES} or 'keep:N' (keep the activations of the last N "
        f"micro-batches, recompute the others; e.g. 'keep:2'), got {mode!r}."
    )


def checkpointed(mode: str, micro: int, chunks: int) -> bool:
    """Whether micro-batch ``micro`` drops its activations in the forward and recomputes them in the backward.

    ``except_last`` keeps the last micro-batch: it is the first to be back-propagated, so recomputing it
    would be done at once, with nothing to overlap. ``keep:N`` keeps the last ``N`` for the same reason:
    they are back-propagated first, and a recompute of one of them would have nothing to overlap, whereas
    the earlier ones recompute while the stage waits for their output gradients. So memory buys back
    exactly the recomputes that cost the most.

    >>> [checkpointed("except_last", i, 3) for i in range(3)]
    [True, True, False]
    >>> [checkpointed("keep:2", i, 4) for i in range(4)]
    [True, True, False, False]
    """
    check_checkpoint_mode(mode)
    if mode == "always":
        return True
    if mode == "except_last":
        return micro < chunks - 1
    count = kept_count(mode)
    if count is not None:
        return micro < chunks - count
    return False


def is_recomputing() -> bool:
    """True while a checkpointed micro-batch is being recomputed for its backward.

    Buffers a layer writes in its forward are handled by the engine (see :class:`ForwardWrites`): the
    recompute sees them as the forward did, and they keep the forward's values after it. A layer that
    changes other state in its forward (a Python attribute, a list) checks this to change it once per
    micro-batch, not twice.
    """
    return getattr(_local, "recomputing", False)


@contextmanager
def recomputing() -> Iterator[None]:
    """The recompute of a checkpointed micro-batch: :func:`is_recomputing` is true inside."""
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = False


#: A buffer's place: its module and its name there (the module may replace the tensor, the place stays).
_Slot = tuple[nn.Module, str]


def restore_buffer(buffer: Tensor, value: Tensor) -> None:
    """Give ``buffer`` the value (and the shape) ``value`` holds, in place, without a graph (a recompute calls it per
    written buffer, twice per checkpointed micro-batch).

    Through ``.data`` where the shape is the same: a graph may hold the buffer (BatchNorm's backward keeps the
    running statistics it was given), and a write that bumped its version would make autograd reject that graph.
    A buffer that a forward resized in place, as a quantization observer resizes its ``min_val`` and ``max_val``
    at its first observation, gets its old shape back first: a plain copy of an older value failed there ("The
    size of tensor a (32) must match the size of tensor b (0)").
    """
    if buffer.shape != value.shape:
        with torch.no_grad():
            buffer.resize_(value.shape)
    buffer.data.copy_(value)  # `.data` records no graph: no `no_grad` needed (entering one per buffer tripled the cost)


def _changed(now: Tensor, before: Tensor) -> bool:
    """Whether a buffer holds another shape or value than its copy from before the forward (NaN counts as changed)."""
    return now.shape != before.shape or not torch.equal(now, before)


class ForwardWrites:
    """The buffers a stage's forward writes, kept so that a recompute neither sees nor leaves other values.

    A layer may write a buffer in its forward: BatchNorm's running statistics, the power-iteration
    vectors of ``torch.nn.utils.spectral_norm`` (which also shape the weight it computes), a counter.
    Recomputing a checkpointed micro-batch runs that forward a second time. So, for each checkpointed
    micro-batch, the buffers its forward writes are copied before that forward (:meth:`before`); the
    recompute runs with them put back to those values, and afterwards they get the values they had
    (:meth:`replayed`): the recompute gives the forward's output, and the buffers end as after the
    forward passes alone, as if nothing had been recomputed.

    Which buffers a forward writes is learned, not guessed: a buffer written in place has a new
    ``_version`` (or the module holds a new tensor) after the forward, or, for the copied ones, another
    shape or value. Some kernels write without a new version: BatchNorm's running statistics (so every
    buffer of a norm layer that tracks running statistics counts as written from the start) and a
    quantization-aware layer's observer and fake-quantize state (``fused_moving_avg_obs_fake_quant``,
    which also resizes ``min_val`` at its first call; its recompute then quantized with the values the
    forward had left, 2.4e-3 off a run without re-materialization after 4 steps). Until the first forward has
    been watched, every buffer is copied (once); after it, only the written ones. A buffer first written in a
    later call (a layer that writes every N steps) is learned then: in that one call its recompute starts from
    its current value, and it is still put back afterwards. A ``torch.Generator`` a layer holds (noise drawn from a
    generator of its own) is replayed the same way: the recompute draws what the forward drew; and so are the plain
    attributes a forward writes (a call counter, a running mean kept as a tensor attribute).
    """

    def __init__(self, stage: nn.Module) -> None:
        #: generators the stage's layers hold (a noise layer's own): their state is replayed like a written buffer's
        self._generators = layer_generators(stage)
        self._slots: list[_Slot] = [
            (module, name) for module in stage.modules() for name, b in module._buffers.items() if b is not None
        ]
        self._written: set[int] = {
            i
            for i, (module, _) in enumerate(self._slots)
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
        }
        self._learned = False
        self._attributes = AttributeWrites(stage)  # the plain attributes a forward writes: replayed alike

    def _buffer(self, i: int) -> Tensor:
        module, name = self._slots[i]
        buffer = module._buffers[name]
        assert buffer is not None, f"the buffer {name} of {type(module).__name__} was removed"
        return buffer

    @contextmanager
    def before(self) -> Iterator[Written]:
        """Around the forward of a checkpointed micro-batch: yields the written buffers' values before it.

        The dict is filled on entry (every buffer the first time) and, on exit, kept to the buffers the
        forward wrote, with the layers' own generators' states and, under ``"attributes"``, the plain
        attributes the forward wrote (:class:`~lightning_gpipe.engine.forward_attributes.AttributeWrites`);
        it is what :meth:`replayed` needs for this micro-batch.
        """
        candidates = sorted(self._written) if self._learned else range(len(self._slots))
        values: Written = {i: self._buffer(i).detach().clone() for i in candidates}
        tensors = [self._buffer(i) for i in range(len(self._slots))]
        versions = [t._version for t in tensors]
        states = {-1 - j: g.get_state() for j, g in enumerate(self._generators)}  # negative keys: the generators
        with self._attributes.before() as attributes:
            yield values
        for i, (t, version) in enumerate(zip(tensors, versions)):
            now = self._buffer(i)
            if i in self._written:
                continue
            if now is not t or now._version != version or (i in values and _changed(now, values[i])):
                self._written.add(i)
        self._learned = True
        for i in [i for i in values if i not in self._written]:
            del values[i]
        values.update(states)
        if attributes:
            values["attributes"] = attributes

    @contextmanager
    def replayed(self, values: Written) -> Iterator[None]:
        """The recompute: the buffers hold ``values`` (from :meth:`before`) inside, and what they held before after."""
        current: Written = {i: self._buffer(i).detach().clone() for i in sorted(self._written)}
        current.update({-1 - j: g.get_state() for j, g in enumerate(self._generators)})
        kept = {key: value for key, value in values.items() if key != "attributes"}
        for i, value in kept.items():
            self._put(i, value)
        try:
            with self._attributes.replayed(values.get("attributes", {})):
                yield
        finally:
            for i, value in current.items():
                self._put(i, value)

    def _put(self, key: int, value: Tensor) -> None:
        """Buffer ``key`` (>= 0) or generator ``-1 - key``'s state gets ``value``."""
        if key < 0:
            self._generators[-1 - key].set_state(value)
        else:
            restore_buffer(self._buffer(key), value)
