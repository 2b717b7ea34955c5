"""The check that a stage's layers treat the samples along dim 0 apart, as cutting a batch into micro-batches assumes.

The pipeline runs each micro-batch through the layers on its own and joins the outputs along dim 0. That equals
the whole batch at once only where every layer works per sample. A layer that mixes the samples of dim 0 makes
the result depend on ``chunks``, silently. The common case is a layout mistake, not an exotic layer: a
sequence-first layer (``nn.TransformerEncoderLayer``, ``nn.LSTM`` or ``nn.GRU`` with ``batch_first=False``) given
``(sequence, batch, ...)``, where the cut into micro-batches then falls across the sequence. Every attention
then sees part of the sequence; the shapes all fit and the loss trains, 2e-3 off one device after 4 steps
(measured).

So at the first call whose first micro-batch holds 2 samples or more, each stage runs its layers three more times
on that micro-batch: as it is, with its second half replaced by copies of its first half's samples, and the other
way round. Where every layer works per sample, the kept half's outputs cannot change. The runs have equal shapes,
so they run the same kernels in the same order, and the kept rows come out equal to rounding. A batch and its
halves would instead differ by a kernel's choice (1e-3 with a GPU's TF32 convolutions), summed over the layers.
Replacing each half in turn also catches a layer that is causal along dim 0 (a sequence-first LSTM's later
positions depend on the earlier ones, not the other way).

The decision is made on what leaves the stage (its output and the skips it sends), whose tensors must keep the
batch in dim 0. The layer named is the first whose output changed in the kept rows. A layer that moves the batch
out of dim 0 inside the stage (a transpose to sequence-first) can be named there wrongly, never refused wrongly.

The probe changes nothing the training sees. It runs without a graph, in eval mode (dropout off; BatchNorm, which
mixes samples only in training and has its own warning, uses its running statistics). Its buffers are swapped for
copies, the random streams isolated, and it works on copies of the inputs. What it cannot hide: hooks on the
layers see its calls, and it costs three micro-batch forwards per stage, once.

Written here because neither torch nor Lightning checks this: torch's ``Pipe`` and ``pipelining`` assume it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.forward_attributes import attributes_kept
from lightning_gpipe.engine.layer_errors import note_layer_error
from lightning_gpipe.engine.microbatch import map_tensors, tensors
from lightning_gpipe.engine.rng import generators_kept, layer_generators
from lightning_gpipe.engine.skip import SkipTracker, use_tracker
from lightning_gpipe.engine.structure import per_sample

__all__ = ["Mixing", "MixedSamples", "Probe", "find_mixing", "joined", "mismatch", "probing", "replaced"]

#: Relative difference (Frobenius norm of the kept rows) above which a run counts as changed. Per-sample layers on
#: equal shapes differ by rounding at most (a memory alignment's code path in a BLAS: 1e-7 in float32, one bfloat16
#: step in rare elements); a layer that mixes samples moves them by far more (measured: 0.06 for `x - x.mean(0)`,
#: 0.33 and 0.43 for a sequence-first Transformer layer and LSTM given `(sequence, batch, ...)`).
_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 1e-2}
_DEFAULT_TOLERANCE = 1e-3


class MixedSamples(ValueError):
    """A stage's output for some samples of a micro-batch changed when the others did."""

    @classmethod
    def at(cls, stage: int, found: Mixing, size: int) -> MixedSamples:
        """The error for stage ``stage``, where :func:`find_mixing` found ``found`` on a micro-batch of ``size``."""
        cut = size // 2
        if found.skip_to is not None:  # the layers' outputs kept the samples apart: a skip it sends did not
            return cls(
                f"Stage {stage} sends stage {found.skip_to} a skip whose rows for some samples of a micro-batch of "
                f"{size} changed when the other samples changed (the last {size - cut} replaced by copies of the "
                f"first {cut}, then the other way; relative difference {found.difference:.2g}, tolerance "
                f"{found.tolerance:.0e}; checked once, in eval mode), while the stage's output kept them apart. The "
                "pipeline cuts every skip into micro-batches along dim 0 like the batch, so a skip must hold one row "
                "per sample in dim 0: one stashed transposed (`x.t()`, sequence-first) has the batch in another dim, "
                "and one computed over the batch (a mean over dim 0) mixes the samples. Stash the tensor with the "
                "batch in dim 0 and transpose it after `pop`; for a statistic over the batch, use chunks=1."
            )
        return cls(
            f"Stage {stage} mixes the samples along dim 0, first in layer {found.index} "
            f"({type(found.layer).__name__}): its output for some samples of a micro-batch of {size} changed when the "
            f"other samples changed (the last {size - cut} replaced by copies of the first {cut}, then the other way; "
            f"relative difference {found.difference:.2g}, tolerance {found.tolerance:.0e}; checked once, in eval "
            "mode). The pipeline cuts every batch into micro-batches along dim 0 and runs them apart, so this model "
            "would learn something else than on one device. Most often the layout is sequence-first: "
            "nn.TransformerEncoderLayer, nn.MultiheadAttention, nn.LSTM or nn.GRU with batch_first=False, given "
            "(sequence, batch, ...), where the cut falls across the sequence. Build them with batch_first=True and "
            "pass (batch, sequence, ...). A layer that mixes the samples on purpose (a statistic over the batch) "
            "equals one device only with chunks=1; to run it per micro-batch anyway, as GPipe runs BatchNorm, pass "
            "check_per_sample=False to GPipeStrategy or GPipe."
        )


@dataclass(frozen=True)
class Mixing:
    """What :func:`find_mixing` found: the difference, its tolerance, and the first layer whose output changed."""

    difference: float
    tolerance: float
    index: int
    layer: nn.Module
    #: where the samples mixed in a skip the stage sends (to this stage), not in its output
    skip_to: Optional[int] = None


@dataclass(frozen=True)
class Probe:
    """What :func:`find_mixing` saw: the mixing it found, if any, and the stage's output and skips for the micro-batch
    as it is (for a check of their shapes where the micro-batches have one sample)."""

    mixing: Optional[Mixing]
    output: Any
    leaving: Any


def joined(first: Any, second: Any) -> Optional[Any]:
    """Two micro-batches of one sample each as one of two samples; ``None`` where their forms differ.

    With micro-batches of one sample nothing can be replaced, and a tensor of one sample cannot show which of its
    dims holds the batch (an LSTM's ``h`` of shape ``(1, 1, H)`` looks like one sample). Two of them joined can.
    """
    theirs = tensors(second)
    if len(tensors(first)) != len(theirs):
        return None
    pairs = iter(theirs)

    def join(t: Tensor) -> Tensor:
        u = next(pairs)
        if per_sample(t, 1) and per_sample(u, 1) and t.shape == u.shape and t.dtype == u.dtype:
            return torch.cat([t.detach(), u.detach()])
        return t.detach().clone()

    return map_tensors(join, first)


def replaced(x: Any, size: int, keep_first: bool) -> Any:
    """A copy of ``x`` (a micro-batch of ``size`` samples) with one half's samples replaced by copies of the other's:
    the second half with ``keep_first``, else the first. Tensors without the batch in dim 0 stay as they are."""
    cut = size // 2
    index = torch.arange(size)
    if keep_first:
        index[cut:] = torch.arange(size - cut) % cut
    else:
        index[:cut] = cut + torch.arange(cut) % (size - cut)
    return map_tensors(lambda t: t.index_select(0, index.to(t.device)) if per_sample(t, size) else t, x)


def mismatch(reference: Any, other: Any, size: int, keep_first: bool) -> tuple[float, float]:
    """How far ``other``'s kept rows moved from ``reference``'s, over the float tensors with the batch in dim 0: the
    largest relative difference and the tolerance for its dtype; ``(0.0, 1.0)`` where nothing compares."""
    rows = slice(0, size // 2) if keep_first else slice(size // 2, size)
    worst, tolerance = 0.0, 1.0
    ours, theirs = tensors(reference), tensors(other)
    if len(ours) != len(theirs):
        return worst, tolerance
    for a, b in zip(ours, theirs):
        if a.is_complex() and b.is_complex():  # a spectrum: compared as its real and imaginary parts
            a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
        if not (a.is_floating_point() and per_sample(a, size) and a.shape == b.shape and a.dtype == b.dtype):
            continue
        kept, moved = a[rows].double(), b[rows].double()
        if not torch.isfinite(kept).all():
            continue
        scale, off = kept.norm().item(), (moved - kept).norm().item()
        relative = off / scale if scale > 0 else (0.0 if off == 0 else float("inf"))
        limit = _TOLERANCE.get(a.dtype, _DEFAULT_TOLERANCE)
        if relative / limit > worst / tolerance:
            worst, tolerance = relative, limit
    return worst, tolerance


def _changed(outputs: list[Any], size: int) -> tuple[float, float]:
    """The larger mismatch of the two replaced runs (``outputs[1:]``) against the micro-batch as it is."""
    first = mismatch(outputs[0], outputs[1], size, keep_first=True)
    second = mismatch(outputs[0], outputs[2], size, keep_first=False)
    return max(first, second, key=lambda found: found[0] / found[1])


@contextmanager
def probing(modules: nn.Module) -> Iterator[None]:
    """Inside: ``modules`` in eval mode, without a graph, with copies of their buffers; afterwards as they were, their
    original buffers untouched (a counter written in forward counts no probe)."""
    modes = [(m, m.training) for m in modules.modules()]
    buffers = [(m, name, b) for m in modules.modules() for name, b in m._buffers.items() if b is not None]
    for module, name, buffer in buffers:
        module._buffers[name] = buffer.detach().clone()
    try:
        modules.eval()
        # a layer's own generator draws no probe either, and a call counter in a plain attribute counts none
        with torch.no_grad(), generators_kept(modules), attributes_kept(modules):
            yield
    finally:
        for module, name, buffer in buffers:
            module._buffers[name] = buffer
        for module, mode in modes:
            module.training = mode


def find_mixing(
    layers: Sequence[tuple[int, nn.Module]],
    x: Any,
    received: dict[Any, Tensor],
    size: int,
    seed_layer: Callable[[int], None],
    leaving: Callable[[SkipTracker], Any] = lambda tracker: (),
) -> Probe:
    """Whether ``layers`` mix the samples of ``x``, a micro-batch of ``size`` (2 or more) samples, with the skip
    tensors ``received`` by key (:attr:`Probe.mixing`). Call it inside :func:`probing`. ``seed_layer(index)``
    seeds a layer's random stream, the same in every run, and each run starts from the layer's buffers as they were;
    ``leaving(tracker)`` are the skips the stage sends."""
    runs = [
        (map_tensors(lambda t: t.clone(), x), SkipTracker(map_tensors(lambda t: t.clone(), received), record=True)),
        *(
            (replaced(x, size, keep), SkipTracker(replaced(received, size, keep), record=True))
            for keep in (True, False)
        ),
    ]
    first_changed: Optional[tuple[int, nn.Module]] = None
    for index, layer in layers:
        buffers = [(m, name, b) for m in layer.modules() for name, b in m._buffers.items() if b is not None]
        generators = [(g, g.get_state()) for g in layer_generators(layer)]  # a noise layer's own, if it has one
        outputs = []
        for value, tracker in runs:
            for module, name, buffer in buffers:  # each run from the same state: a counter would count the runs
                module._buffers[name] = buffer.clone()
            for generator, state in generators:
                generator.set_state(state)
            seed_layer(index)
            with use_tracker(tracker), attributes_kept(layer):  # and from the same plain attributes
                try:
                    outputs.append(layer(value))
                except Exception as error:
                    why = ", run first, in eval mode, to check that the layers keep the samples apart"
                    note_layer_error(error, f"Layer {index} ({type(layer).__name__})", 0, x, why)
                    raise
        if first_changed is None:
            difference, tolerance = _changed(outputs, size)
            if difference > tolerance:
                first_changed = (index, layer)
        runs = [(output, tracker) for output, (_, tracker) in zip(outputs, runs)]
    ends = [(value, leaving(tracker)) for value, tracker in runs]
    difference, tolerance = _changed(ends, size)
    index, layer = first_changed or layers[-1]
    mixing = Mixing(difference, tolerance, index, layer) if difference > tolerance else None
    if mixing is not None and first_changed is None:  # no layer's output changed: a skip it sends did
        skips = [sent for _, sent in ends]
        for destination in skips[0] if isinstance(skips[0], dict) else ():
            moved, limit = _changed([sent[destination] for sent in skips], size)
            if moved > limit:
                mixing = Mixing(moved, limit, index, layer, skip_to=destination)
                break
    return Probe(mixing, *ends[0])
