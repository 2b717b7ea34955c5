"""One rank's part of a fill-drain pipeline: its stage's micro-batch loop and the autograd bridge.

The forward (fill) runs inside one ``torch.autograd.Function``, so the caller's code is unchanged:
it gets the backbone's real output on every rank, computes its loss and calls ``backward``. That
backward is the drain: micro-batches in reverse, each recomputed if it was checkpointed, each input
gradient sent to the previous stage. Parameter gradients build up in place, as in a one-device run.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.batchnorm import micro_batches
from lightning_gpipe.engine.channels import Channels
from lightning_gpipe.engine.checkpoint import ForwardWrites, Written, check_checkpoint_mode, checkpointed, recomputing
from lightning_gpipe.engine.deadlock import blocked
from lightning_gpipe.engine.layer_errors import note_layer_error
from lightning_gpipe.engine.lockstep import check_message
from lightning_gpipe.engine.messages import EVAL_CALLS, Message, Tag
from lightning_gpipe.engine.micro_batch_writes import named_state_writes, watching_state
from lightning_gpipe.engine.replicas import GradientSync
from lightning_gpipe.engine.rng import (
    HostDraws,
    host_state,
    host_streams,
    isolated_rng,
    layer_seed,
    same_host_state,
    seed_host,
    seed_layer,
)
from lightning_gpipe.engine.sample_check import MixedSamples, find_mixing, joined, probing
from lightning_gpipe.engine.schedule import fill_drain
from lightning_gpipe.engine.selective import back_into_inputs, fills_every_leaf
from lightning_gpipe.engine.skip import SkipTracker, StageSkips, use_tracker
from lightning_gpipe.engine.skip.traffic import Bundles
from lightning_gpipe.engine.split_backward import WeightPass, inputs_first
from lightning_gpipe.engine.stage_input import FirstStageInputs, KeptInputs, enter
from lightning_gpipe.engine.structure import Skeleton, Structure, flatten, per_sample, unflatten
from lightning_gpipe.engine.tracer import Tracer, span

__all__ = ["StageRunner"]


def differentiable(t: Tensor) -> bool:
    """Whether autograd can carry a gradient for ``t``: floating point, or complex (a spectral layer's ``rfft``
    output crossing a boundary; counted with the integers before, it cut the gradient to the stages before it)."""
    return t.is_floating_point() or t.is_complex()


@dataclass
class _Run:
    """What one training forward leaves behind for its backward."""

    call: int
    autocast: tuple[bool, torch.dtype]
    label: str = ""  # the hook that made the call: every message of the call carries it
    inputs: list[Any] = field(default_factory=list)  # per micro-batch: the stage input (leaves)
    outputs: list[Optional[tuple[Tensor, ...]]] = field(default_factory=list)  # None when checkpointed
    in_grad: list[bool] = field(default_factory=list)  # whether the previous stage waits for input grads
    out_grad: list[bool] = field(default_factory=list)  # whether the next stage sends output grads
    sizes: list[int] = field(default_factory=list)  # micro-batch sizes: min(chunks, batch size) of them
    buffers: list[Optional[Written]] = field(default_factory=list)  # checkpointed: what its forward wrote, before
    skips_in: list[Optional[Bundles]] = field(default_factory=list)  # skips received (leaves), by source stage
    skip_in_grad: list[dict[int, bool]] = field(default_factory=list)  # which sources wait for the skips' gradients
    skips_out: list[Optional[Bundles]] = field(default_factory=list)  # skips sent, by destination; None: checkpointed
    skip_out_grad: list[dict[int, bool]] = field(default_factory=list)  # which destinations send gradients back
    input_needs_grad: bool = False
    #: per tensor of the pipeline's output: whether it requires grad, as it would on one device (see ``_share``)
    output_grad: list[bool] = field(default_factory=list)
    first_inputs: FirstStageInputs = field(default_factory=FirstStageInputs)  # the first stage's input leaves
    host_keyed: bool = False  # whether the layers seed Python's and NumPy's generators (see rng.HostDraws)


class StageRunner:
    """Runs stage ``stage`` of the pipeline on ranks ``ranks``: the engine behind ``GPipe.forward``.

    ``layers`` are this stage's ``(index in the full Sequential, layer)`` pairs; the index keys the
    random streams, so a layer draws the same numbers whichever stage it lands in.
    """

    def __init__(
        self,
        layers: list[tuple[int, nn.Module]],
        stage: int,
        ranks: list[int],
        channels: Optional[Channels],
        chunks: int,
        checkpoint: str,
        device: torch.device,
        seed: int,
        skips: Optional[StageSkips] = None,
    ) -> None:
        check_checkpoint_mode(checkpoint)
        microbatch.check_chunks(chunks)
        if len(ranks) > 1 and channels is None:
            raise ValueError("A pipeline of several stages needs `channels` to talk over.")
        self.layers, self.stage, self.ranks = layers, stage, ranks
        self.channels, self.chunks, self.checkpoint = channels, chunks, checkpoint
        self.device, self.seed = device, seed
        self.skips = skips or StageSkips()  # the skip connections to and from other stages
        #: Input gradients first in the drain (see :mod:`lightning_gpipe.engine.split_backward`).
        self.split_backward = False
        self.split_passes = 0  # micro-batch backwards that ran split (the others ran whole)
        #: Whether the first call with a micro-batch of 2 samples or more checks that the layers work per sample
        #: (:mod:`lightning_gpipe.engine.sample_check`); ``per_sample_checked`` once it ran.
        self.check_per_sample = True
        self.per_sample_checked = False
        #: Whether a training call cut into 2 micro-batches or more has been watched for layers that move their own
        #: state in the forward (:mod:`lightning_gpipe.engine.micro_batch_writes`).
        self.state_writes_watched = False
        self._held: Any = None  # micro-batch 0's input and skips, where micro-batches of one sample are checked joined
        self.grad_sync: Optional[GradientSync] = None  # set with data-parallel replicas
        self.after_drain: Optional[Callable[[], None]] = None  # e.g. sums tied weights' gradients over stages
        #: Told of an error that leaves a call or a drain of this stage: the plain GPipe publishes it on its own failure
        #: board, so that the other stages, which wait for this one's messages, end with its cause. (The Lightning
        #: strategy publishes in its ``on_exception`` and leaves this unset.)
        self.on_error: Optional[Callable[[BaseException], None]] = None
        self.calls = 0  # training calls so far: with the seed, the key of every random stream (checkpointed)
        self.eval_calls = 0
        self._evaluating = 0  # evaluation fills under way
        #: Training calls whose drain has not run yet, by call number. Weak: a call whose output is never
        #: back-propagated (a detached backbone output, a step that skips its backward) stops counting once
        #: autograd frees its graph, and with it the run.
        self._undrained: weakref.WeakValueDictionary[int, _Run] = weakref.WeakValueDictionary()
        #: The call whose drain runs now, with the hook that made it, or None: see :meth:`_refuse_call_in_drain`.
        self._draining: Optional[_Run] = None
        #: What names the caller's current context in every message (Lightning: the running hook), so that
        #: stages that make their calls from different places fail at once. Plain PyTorch: nothing.
        self.label: Callable[[], str] = lambda: ""
        #: The fingerprint of the batch of the current step (see :func:`microbatch.fingerprint`), set by the
        #: caller before the call; ``None``: the backbone input's own fingerprint is used.
        self.batch_fingerprint: Optional[int] = None
        self.tracer: Optional[Tracer] = None
        self._modules = nn.ModuleList(m for _, m in layers)
        self._host = HostDraws()  # which layers draw from Python's `random` or NumPy's global generator
        self._writes = ForwardWrites(self._modules)
        self._kept = KeptInputs(stage)  # a checkpointed micro-batch's input, unwritten for its recompute

    @property
    def open_calls(self) -> int:
        """Calls under way: evaluation fills, and training calls that may still drain. While there are none, no
        message from a peer should wait untaken (see ``GPipe.idle_stray``)."""
        return self._evaluating + len(self._undrained)

    def _span(self, kind: str, micro: int = -1) -> AbstractContextManager[None]:
        return span(self.tracer, kind, micro)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == len(self.ranks) - 1

    def __call__(self, batch: Any) -> microbatch.Outputs:
        """The backbone's output for ``batch``, on every rank of the pipeline."""
        self._refuse_call_in_drain()
        label = self.label()
        if not torch.is_grad_enabled():
            # evaluation calls count apart, so that validating does not move the training's random streams
            call = EVAL_CALLS + self.eval_calls
            self.eval_calls += 1
            self._evaluating += 1
            try:
                return unflatten(*self._fill(batch, _Run(call, (False, torch.float32), label), train=False))
            except BaseException as error:
                self._tell(error)
                raise
            finally:
                self._evaluating -= 1
        call = self.calls
        self.calls += 1
        if call == 0 and self.is_first and self.ranks[0] == 0:  # once, on the job's first rank
            self._note_small_first_batch(microbatch.batch_size(batch))
        leaves = microbatch.tensors(batch)
        anchor = torch.empty(0, device=self.device, requires_grad=True)  # see _Bridge
        box: dict[str, Any] = {"label": label}
        try:
            values = _Bridge.apply(self, batch, call, box, anchor, *leaves)
        except BaseException as error:
            self._undrained.pop(call, None)
            self._tell(error)
            raise
        return unflatten(values, box["structure"])

    def _tell(self, error: BaseException) -> None:
        if self.on_error is not None:
            self.on_error(error)

    def _refuse_call_in_drain(self) -> None:
        """Raise where the backbone is called from inside a drain of this stage: each stage would make that call at
        its own moment of its drain, and wait there for stages that are still draining (a deadlock, named only
        after ``failure_timeout``). torch's ``checkpoint(..., use_reentrant=False)`` around the backbone does it: its
        recompute runs the region's forward again when the backward first unpacks a tensor saved in it, which is
        inside each stage's drain. The reentrant form recomputes before the region's backward, and works."""
        run = self._draining
        if run is None:
            return
        made = f" (made in `{run.label}`)" if run.label else ""
        raise RuntimeError(
            f"The backbone was called while stage {self.stage} back-propagated backbone call {run.call}{made}: a "
            "`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around the backbone (or another "
            "saved-tensor hook that recomputes) runs its forward again from inside the backward, at a different "
            "moment on each stage, so the stages would wait for each other. The pipeline re-materializes by itself: "
            "call the backbone outside torch.utils.checkpoint and choose GPipeStrategy(checkpoint=...) ('always' "
            "keeps only each micro-batch's input to a stage), or use `use_reentrant=True`."
        )

    def _note_small_first_batch(self, size: int) -> None:
        """Warn where the first training batch has fewer samples than ``chunks``: it is cut into one micro-batch per
        sample. The results are the same, but the pipeline runs fewer micro-batches than it was given, so its bubble
        is larger; batches that stay that small mean ``chunks`` was set too high (a short last batch, or a small
        evaluation batch later, is cut the same way without a word)."""
        if size < self.chunks:
            warnings.warn(
                f"The first training batch has {size} samples, fewer than chunks={self.chunks}: it is cut into {size} "
                f"micro-batches of one sample, and so is every batch of fewer than {self.chunks} samples (the results "
                f"are the same; the pipeline's bubble is larger than with {self.chunks} micro-batches). If the batches "
                f"stay this small, set chunks to at most {size}, or raise the batch size.",
                stacklevel=3,
            )

    def _fingerprint(self, batch: Any) -> int:
        if len(self.ranks) == 1:
            return 0  # nothing to compare with
        return self.batch_fingerprint if self.batch_fingerprint is not None else microbatch.fingerprint(batch)

    # -- forward (fill) ------------------------------------------------------------------------------

    def _run_layers(
        self,
        x: Any,
        call: int,
        micro: int,
        received: Bundles,
        host_keyed: bool = False,
        drawing: Optional[list[int]] = None,
    ) -> tuple[tuple[Tensor, ...], Structure, Bundles]:
        """The stage's layers on one micro-batch: its output's tensors and structure, and the skips it sends.

        ``host_keyed``: each layer also seeds Python's and NumPy's generators; ``drawing`` (a stage's first call)
        gets the layers that drew from them (see :class:`~lightning_gpipe.engine.rng.HostDraws`)."""
        x = enter(x)  # an in-place first layer works on it, as on one device (see stage_input)
        received = {src: enter(bundle) for src, bundle in received.items()}
        tracker = SkipTracker(self.skips.keyed(received), record=True)
        given = x
        with isolated_rng(self.device), use_tracker(tracker):
            for index, layer in self.layers:
                key = layer_seed(self.seed, call, micro, index)
                seed_layer(key, self.device)
                if host_keyed:
                    seed_host(key)
                seeded = host_state() if drawing is not None else None
                try:
                    x = layer(x)
                except Exception as error:
                    note_layer_error(error, self._describe_layer(index), micro, given)
                    raise
                if drawing is not None and seeded is not None and not same_host_state(seeded, host_state()):
                    drawing.append(index)
        leaving = self.skips.outgoing(tracker, self._describe_layer)
        try:
            return (*flatten(x), leaving)
        except TypeError as error:
            index, layer = self.layers[-1]
            where = "the pipeline's output" if self.is_last else f"the boundary to stage {self.stage + 1}"
            raise TypeError(
                f"Layer {index} ({type(layer).__name__}), the last of stage {self.stage}, {error} at {where}. "
                "Make it return one, or move the stage boundary with `balance`."
            ) from None

    def _mode(self) -> tuple[bool, ...]:
        """The layers' ``training`` flags: what :class:`~lightning_gpipe.engine.rng.HostDraws` learns per."""
        return tuple(layer.training for _, layer in self.layers)

    def _drew(self, run: _Run, flags: tuple[bool, ...]) -> None:
        """Python's or NumPy's global generator moved during a call that did not seed them (see
        :class:`~lightning_gpipe.engine.rng.HostDraws`): seed them per layer from now on, and say so once."""
        if not self._host.draws_from_now_on(flags, [index for index, _ in self.layers]):
            return
        mode = "training" if all(flags) else "evaluation" if not any(flags) else "this mix of training and evaluation"
        warnings.warn(
            f"Python's `random` or NumPy's global generator was drawn from while stage {self.stage} ran pipeline call "
            f"{run.call}, though none of its layers ({self._describe_layer(self.layers[0][0])} to "
            f"{self._describe_layer(self.layers[-1][0])}) drew in the stage's first call in {mode} mode, where the "
            "pipeline looks for such layers. If another thread of this process drew (a logger's), nothing is wrong. "
            "If a layer started drawing, its draws in this call came from this process's own state, so they would "
            "differ with another number of stages, and a checkpointed micro-batch's recompute drew others again. "
            "From now on the stage seeds both per (seed, call, micro-batch, layer), as it seeds torch's generators "
            "(about 5 us per layer and micro-batch). A layer that draws from torch's generators (`torch.rand`), or "
            "from one it holds (`random.Random(seed)`), is keyed from its first call.",
            stacklevel=2,
        )

    def _describe_layer(self, index: int) -> str:
        return f"Layer {index} ({type(dict(self.layers)[index]).__name__}) on stage {self.stage}"

    def _recv(self, src: int, expected: Tag) -> Message:
        """The next message from rank ``src``, which must be ``expected`` (see :mod:`.lockstep`)."""
        assert self.channels is not None
        name = self.channels.inboxes[src].name
        with self._span("wait", expected.micro), blocked(lambda: f"{expected.describe()} from {name}", (src,)):
            message = self.channels.recv(src)
        return check_message(message, expected, name, self.stage)

    def _recv_stage(self, expected: Tag, stage: int) -> Message:
        return self._recv(self.ranks[stage], expected)

    def _send(self, dst: int, values: Any, requires_grad: list[bool], structure: Structure, tag: Tag) -> None:
        assert self.channels is not None
        self.channels.send(dst, values, requires_grad, structure, tag)

    def _fill(self, batch: Any, run: _Run, train: bool) -> tuple[tuple[Tensor, ...], Structure]:
        """Every micro-batch through this stage, in order; returns the pipeline's output tensors and structure."""
        call = run.call
        # Every rank holds the same batch, so every rank cuts it alike: min(chunks, batch size) micro-batches.
        sizes = microbatch.split_sizes(microbatch.batch_size(batch), self.chunks)
        count = len(sizes)
        fingerprint = self._fingerprint(batch)
        micro_inputs = microbatch.split(batch, sizes) if self.is_first else []
        needs_grad = train and any(p.requires_grad for p in self._modules.parameters())
        outputs: list[tuple[Tensor, ...]] = []
        output_grad: dict[bool, list[list[bool]]] = {True: [], False: []}  # by whether the flags were seen
        structures: list[Structure] = []
        # a DeferredBatchNorm commits after the last micro-batch of this call; Python's and NumPy's generators are
        # seeded per layer where this stage's layers draw from them, and the caller gets them back (rng.HostDraws)
        mode = self._mode()
        run.host_keyed = self._host.keyed(mode)
        drawing: Optional[list[int]] = [] if self._host.learning(mode) else None  # watched on micro-batch 0
        with micro_batches(count), host_streams(run.host_keyed, partial(self._drew, run, mode)):
            for task in fill_drain(count, self.checkpoint)[0]:
                i = task.micro
                if self.is_first:
                    x = run.first_inputs.leaves(micro_inputs[i]) if train else micro_inputs[i]
                    in_flags = [t.requires_grad for t in microbatch.tensors(x)]
                else:
                    message = self._recv(self.ranks[self.stage - 1], Tag("forward", call, i, run.label, fingerprint))
                    in_flags = list(message.requires_grad) if train else []
                    values = tuple(
                        v.requires_grad_() if train and f else v
                        for v, f in zip(message.tensors(), message.requires_grad)
                    )
                    x = unflatten(values, message.structure)
                skip_tag = Tag("skip", call, i, run.label, fingerprint)
                received, skip_in_grad = self.skips.receive(partial(self._recv_stage, skip_tag), train)
                if i < 2 and self._sample_check_due(sizes):
                    self._check_per_sample(x, self.skips.keyed(received), sizes, i, call)
                recompute = train and checkpointed(self.checkpoint, i, count)
                writes: AbstractContextManager[Written] = (
                    self._writes.before() if recompute else nullcontext({})  # what the recompute must replay
                )
                layers_x, layers_received, watched = (
                    self._kept.for_forward(x, received) if recompute else (x, received, [])
                )
                watch_state = train and i == 1 and not self.state_writes_watched
                state: AbstractContextManager[dict[int, list[str]]] = (
                    watching_state(self.layers) if watch_state else nullcontext({})
                )
                with (
                    torch.set_grad_enabled(train and not recompute),
                    self._span("forward", i),
                    writes as buffers,
                    state as moved,
                ):
                    y, structure, leaving = self._run_layers(
                        layers_x, call, i, layers_received, run.host_keyed, drawing if i == 0 else None
                    )
                if watch_state:
                    self.state_writes_watched = True
                    if moved:
                        warnings.warn(named_state_writes(moved, self.layers, self.chunks), stacklevel=2)
                if recompute:
                    self._kept.after_forward(watched, i)
                elif train and self.is_first:
                    run.first_inputs.pass_on_writes(i)
                self._check_batch_dim(y, sizes[i])  # before anything leaves the stage
                for dst, values in leaving.items():
                    self._check_batch_dim(values, sizes[i], skip_to=dst)
                grad_flows = train and (needs_grad or any(in_flags) or any(skip_in_grad.values()))
                out_flags = [grad_flows and differentiable(t) for t in y]
                skip_flags = {dst: [grad_flows and differentiable(t) for t in v] for dst, v in leaving.items()}
                if train:
                    run.inputs.append(x)
                    run.outputs.append(None if recompute else y)
                    run.buffers.append(buffers if recompute else None)
                    run.in_grad.append(any(in_flags))
                    run.out_grad.append(any(out_flags))
                    run.skips_in.append(received)
                    run.skip_in_grad.append(skip_in_grad)
                    run.skips_out.append(None if recompute else leaving)
                    run.skip_out_grad.append({dst: any(flags) for dst, flags in skip_flags.items()})
                if self.is_last:
                    outputs.append(tuple(t.detach() for t in y))
                    # where the layers ran with autograd, the flags they made; under recompute, the ones foreseen
                    seen = train and not recompute
                    output_grad[seen].append([t.requires_grad for t in y] if seen else out_flags)
                    structures.append(structure)
                else:
                    tag = Tag("forward", call, i, run.label, fingerprint)
                    self._send(self.ranks[self.stage + 1], y, out_flags, structure, tag)
                for dst, values in leaving.items():  # after the activations: the order every receiver expects
                    self._send(self.ranks[dst], values, skip_flags[dst], True, skip_tag)
        if drawing is not None:
            self._host.learnt(mode, drawing)
        run.sizes = sizes
        values, structure, run.output_grad = self._share(
            outputs,
            [any(flags) for flags in zip(*(output_grad[True] or output_grad[False]))],
            structures,
            Tag("output", call, -1, run.label),
        )
        return values, structure

    def _sample_check_due(self, sizes: list[int]) -> bool:
        """Whether this call checks the layers per sample: the first that cuts the batch (with ``chunks=1`` nothing is
        cut, so anything goes), on its first micro-batch, or on its first two joined where they have 1 sample each."""
        return self.check_per_sample and not self.per_sample_checked and self.chunks > 1 and sum(sizes) > 1

    def _check_per_sample(self, x: Any, received: dict[Any, Tensor], sizes: list[int], i: int, call: int) -> None:
        """Refuses layers that mix the samples of a micro-batch (see :mod:`~lightning_gpipe.engine.sample_check`).

        Micro-batches of one sample (``chunks`` at least the batch size) are checked on the first two joined: the
        input of micro-batch 0 waits for micro-batch 1's. There the outputs' shapes are checked too, which one sample
        cannot show.
        """
        if sizes[0] > 1:
            if i == 0:
                self._probe(x, received, sizes[0], call)
            return
        if i == 0:
            self._held = microbatch.map_tensors(lambda t: t.detach().clone(), (x, received))  # before its forward
            return
        first, first_received = self._held
        self._held = None
        pair, pair_received = joined(first, x), joined(first_received, received)
        if pair is None or pair_received is None:  # forms that differ between micro-batches: nothing to compare
            self.per_sample_checked = True
            return
        self._probe(pair, pair_received, 2, call, joined_from_single_samples=True)

    def _probe(
        self, x: Any, received: dict[Any, Tensor], size: int, call: int, joined_from_single_samples: bool = False
    ) -> None:
        """Runs the check on micro-batch ``x`` of ``size`` samples (see :func:`~.sample_check.find_mixing`)."""
        self.per_sample_checked = True

        def seed(index: int) -> None:  # each of the check's runs of a layer draws the same numbers
            key = layer_seed(self.seed, call, 0, index)
            seed_layer(key, self.device)
            seed_host(key)

        leaving = lambda tracker: self.skips.outgoing(tracker, self._describe_layer)  # noqa: E731
        with isolated_rng(self.device, everything=True), probing(self._modules):
            try:
                probe = find_mixing(self.layers, x, received, size, seed, leaving)
            except Exception as error:
                if not joined_from_single_samples:
                    raise
                raise RuntimeError(
                    f"Stage {self.stage}'s per-sample check ran its layers on two micro-batches of one sample joined "
                    f"into one of two, and they failed with {type(error).__name__}: {error}. Every layer must take "
                    "any number of samples (a short last batch, a larger validation batch); if these need one "
                    "sample each, pass check_per_sample=False to GPipeStrategy or GPipe."
                ) from error
        if joined_from_single_samples:
            note = (
                " (checked on 2 samples joined from micro-batches of 1, where a tensor of 1 sample cannot show which "
                "dim holds the batch)"
            )
            self._check_batch_dim(tuple(microbatch.tensors(probe.output)), size, note=note)
            for dst, values in probe.leaving.items():
                self._check_batch_dim(tuple(values), size, skip_to=dst, note=note)
        if probe.mixing is not None:
            raise MixedSamples.at(self.stage, probe.mixing, size)

    def _check_batch_dim(self, y: tuple[Tensor, ...], size: int, skip_to: Optional[int] = None, note: str = "") -> None:
        """Every tensor that leaves the stage has the micro-batch in dim 0 (shapes only: cheap).

        The pipeline cuts the batch into micro-batches and joins the outputs along dim 0. A tensor that
        is not per sample (a statistic over the batch, a 0-dim tensor) would be computed per micro-batch
        and travel on as if it were: a silently different result. So it is refused, naming the layer.
        """
        for t in y:
            if per_sample(t, size):
                continue
            index, layer = self.layers[-1]
            if skip_to is not None:
                raise ValueError(
                    f"A skip that stage {self.stage} stashes for stage {skip_to} has shape {tuple(t.shape)} for a "
                    f"micro-batch of {size} samples{note}. A skip between stages travels per micro-batch, so it must "
                    "keep the batch in dim 0: stash per-sample values, or move the stage boundary with `balance` so "
                    "that the stash and its pop land on one stage."
                )
            if self.is_last:
                where = "as the backbone's output, where the micro-batch outputs are joined along dim 0"
            else:
                where = (
                    f"across the boundary from stage {self.stage} to stage {self.stage + 1}, where each micro-batch's "
                    "tensors travel on their own (a statistic over the batch would be one of the micro-batch only)"
                )
            raise ValueError(
                f"Layer {index} ({type(layer).__name__}), the last of stage {self.stage}, returned a tensor of shape "
                f"{tuple(t.shape)} for a micro-batch of {size} samples{note} {where}. Every tensor that leaves a stage "
                "must keep the batch in dim 0: return per-sample values, or move the stage boundary with `balance` so "
                "that this tensor stays inside a stage."
            )

    def _share(
        self, outputs: list[tuple[Tensor, ...]], grad: list[bool], structures: list[Structure], tag: Tag
    ) -> tuple[tuple[Tensor, ...], Structure, list[bool]]:
        """The last stage joins the micro-batch outputs and sends them to every other stage, with ``grad``: which of
        them require grad. Every rank then marks the others as not differentiable, so that where nothing before them
        requires grad (a frozen backbone, its input a plain tensor) they do not either, as on one device: a loss made
        of them alone then fails at its backward, as there, instead of running a drain that trains nothing."""
        if self.is_last:
            values, structure = microbatch.gather(outputs), self._one_structure(structures)
            for rank in self.ranks[:-1]:
                self._send(rank, values, grad, structure, tag)
        else:
            message = self._recv(self.ranks[-1], tag)
            values, structure, grad = message.tensors(), message.structure, list(message.requires_grad)
        if self.channels is not None:
            with self._span("wait"):
                self.channels.flush()
        return values, structure, grad

    def _one_structure(self, structures: list[Structure]) -> Structure:
        """The backbone output's structure. The micro-batches' outputs join tensor by tensor, so a value beside the
        tensors would be one micro-batch's, not the batch's (a count, a mean, a flag computed from the samples):
        only ``None`` may sit there, and the form must be the same in every micro-batch."""
        index, layer = self.layers[-1]
        named = f"Layer {index} ({type(layer).__name__}), the backbone's last,"
        kept = structures[0].constants() if isinstance(structures[0], Skeleton) else []
        if any(value is not None for value in kept):
            shown = ", ".join(repr(value) for value in kept if value is not None)
            raise ValueError(
                f"{named} returned {shown} beside its tensors. The pipeline runs the backbone on micro-batches and "
                "joins their outputs tensor by tensor, so such a value would be one micro-batch's, not the batch's. "
                "Return it as a tensor with the batch in dim 0 (per sample), or compute it outside the backbone."
            )
        if any(s != structures[0] for s in structures[1:]):
            raise ValueError(
                f"{named} returned outputs of different forms for the micro-batches of one batch. The pipeline joins "
                "the micro-batches' outputs tensor by tensor into the backbone's output, so their forms must match."
            )
        return structures[0]

    # -- backward (drain) ----------------------------------------------------------------------------

    def _drain(self, run: _Run, grads: tuple[Optional[Tensor], ...], whole: bool = True) -> list[Optional[Tensor]]:
        """Back-propagate every micro-batch in reverse; returns the gradients of the pipeline input's leaves.

        The parameters' gradients go to their ``.grad``; not ``whole`` (a backward that asked for some gradients
        only, see :mod:`~lightning_gpipe.engine.selective`), only the inputs' are computed.
        """
        count = len(run.sizes)  # as in the fill: min(chunks, batch size)
        if self.is_last:
            parts = [torch.split(g, run.sizes) if g is not None else [None] * count for g in grads]
            last_grads = [tuple(p[i] for p in parts) for i in range(count)]
        input_grads: list[tuple[Optional[Tensor], ...]] = [()] * count
        recomputed: dict[int, tuple[tuple[Tensor, ...], Bundles]] = {}
        for task in fill_drain(count, self.checkpoint)[1]:
            i = task.micro
            if task.kind == "recompute":
                if run.out_grad[i] or any(run.skip_out_grad[i].values()):
                    recomputed[i] = self._recompute(run, i)
                continue
            y, leaving = recomputed.pop(i) if i in recomputed else (run.outputs[i], run.skips_out[i])
            g: tuple[Optional[Tensor], ...] = ()
            if run.out_grad[i]:
                g = (
                    last_grads[i]
                    if self.is_last
                    else self._recv(self.ranks[self.stage + 1], Tag("gradient", run.call, i, run.label)).values
                )
            pairs = [(o, d) for o, d in zip(y or (), g) if d is not None and o.requires_grad]
            for dst, wanted in run.skip_out_grad[i].items():  # the skips' gradients, from the stages of their pops
                if wanted:
                    skip_grads = self._recv(self.ranks[dst], Tag("skip gradient", run.call, i, run.label)).values
                    sent = leaving[dst] if leaving is not None else ()
                    pairs += [(o, d) for o, d in zip(sent, skip_grads) if d is not None and o.requires_grad]
            if i == 0 and self.grad_sync is not None and whole:  # the last backward: .grad becomes final
                self.grad_sync.arm()
            weights: Optional[WeightPass] = None
            with self._span("backward", i):
                outs, douts = [o for o, _ in pairs], [d for _, d in pairs]
                if pairs and not whole:
                    back_into_inputs(outs, douts, self._input_leaves(run, i))
                elif pairs and self.split_backward and not self.is_first:  # the first stage: nobody waits
                    weights = inputs_first(outs, douts, self._input_leaves(run, i))
                if pairs and whole and weights is None:
                    torch.autograd.backward(outs, douts)
                # None where no gradient reached an input (a stop-gradient, a branch this call did not use): zeros
                # would make the upstream stage's parameters' .grad zeros instead of None, and an optimizer steps a
                # parameter with a zero gradient (momentum, weight decay, Adam's moments) but skips one with None
                dx = tuple(t.grad if t.requires_grad else None for t in microbatch.tensors(run.inputs[i]))
            if not self.is_first and run.in_grad[i]:
                tag = Tag("gradient", run.call, i, run.label)
                self._send(self.ranks[self.stage - 1], dx, [False] * len(dx), True, tag)
            received = run.skips_in[i]
            assert received is not None
            for src, wanted in run.skip_in_grad[i].items():  # after the input gradient: the order senders expect
                if wanted:
                    grads = self.skips.input_grads(received, src)
                    tag = Tag("skip gradient", run.call, i, run.label)
                    self._send(self.ranks[src], grads, [False] * len(grads), True, tag)
            if weights is not None:  # the weight gradients, while the previous stage works on the input gradient
                with self._span("backward", i):
                    weights()
                self.split_passes += 1
            input_grads[i] = dx
            run.inputs[i] = run.outputs[i] = run.buffers[i] = run.skips_in[i] = run.skips_out[i] = None
        return self._input_grads(run, input_grads)

    @staticmethod
    def _input_leaves(run: _Run, i: int) -> list[Tensor]:
        """Micro-batch ``i``'s input and received skips that want a gradient: what an input pass fills."""
        received = [t for bundle in (run.skips_in[i] or {}).values() for t in bundle]
        return [t for t in (*microbatch.tensors(run.inputs[i]), *received) if t.requires_grad]

    def _recompute(self, run: _Run, i: int) -> tuple[tuple[Tensor, ...], Bundles]:
        """Rebuild micro-batch ``i``'s graph: same input, random streams, autocast and written buffers as the forward.

        The buffers the forward wrote are put back to their values before it for the recompute, and to their
        current values after it (see :class:`~lightning_gpipe.engine.checkpoint.ForwardWrites`).
        """
        autocast = torch.autocast(self.device.type, dtype=run.autocast[1], enabled=run.autocast[0])
        buffers, received = run.buffers[i], run.skips_in[i]
        assert buffers is not None and received is not None  # a checkpointed micro-batch's, from the fill
        with self._span("recompute", i), torch.enable_grad(), autocast, recomputing():
            with self._writes.replayed(buffers):
                y, _, leaving = self._run_layers(run.inputs[i], run.call, i, received, run.host_keyed)
        if self.is_first:
            run.first_inputs.pass_on_writes(i)
        return y, leaving

    def _input_grads(self, run: _Run, per_micro: list[tuple[Optional[Tensor], ...]]) -> list[Optional[Tensor]]:
        """The first stage joins the input gradients and sends them to every stage (they all share the input)."""
        grads: list[Optional[Tensor]] = []
        tag = Tag("input gradient", run.call, -1, run.label)
        if run.input_needs_grad:
            if self.is_first:
                grads = [_join(col, run.sizes) for col in zip(*per_micro)]
                for rank in self.ranks[1:]:
                    self._send(rank, grads, [False] * len(grads), True, tag)
            else:
                grads = list(self._recv(self.ranks[0], tag).values)
        if self.channels is not None:
            with self._span("wait"):
                self.channels.flush()
        return grads


def _join(per_micro: tuple[Optional[Tensor], ...], sizes: list[int]) -> Optional[Tensor]:
    """An input's gradient over the batch from its micro-batches': ``None`` if none got one, else zeros for those."""
    present = next((g for g in per_micro if g is not None), None)
    if present is None:
        return None
    return torch.cat(
        [g if g is not None else present.new_zeros((n, *present.shape[1:])) for g, n in zip(per_micro, sizes)]
    )


class _Bridge(torch.autograd.Function):
    """The pipeline as one autograd node on every rank.

    Its inputs are the batch's tensors (so a module before the backbone gets its gradient) and an
    ``anchor`` that requires grad: on ranks other than the first the batch is never used, and without
    the anchor the output would have no ``grad_fn`` and backward would never reach the stage. Only a
    whole ``backward()`` reaches the anchor: the drain then adds the parameters' gradients to their
    ``.grad``, as one device's backward does. A backward that asks for some gradients only
    (``torch.autograd.grad``, ``backward(inputs=...)``) does not: the drain then computes the input
    gradients alone.
    """

    @staticmethod
    def forward(ctx, runner: StageRunner, batch: Any, call: int, box: dict, anchor: Tensor, *leaves: Tensor):
        kind = runner.device.type
        run = _Run(call, (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)), box["label"])
        run.input_needs_grad = any(t.requires_grad for t in leaves)
        runner._undrained[call] = run  # open until the drain ends, or autograd frees the graph without one
        with runner._span("fill"):
            values, box["structure"] = runner._fill(batch, run, train=True)
        ctx.runner, ctx.run, ctx.num_leaves = runner, run, len(leaves)
        ctx.anchor = torch.autograd.graph.get_gradient_edge(anchor).node  # which backward reaches it: see backward
        ctx.set_materialize_grads(False)
        # as on one device: an output that nothing requiring grad made (see StageRunner._share) does not require it
        constant = [v for v, g in zip(values, run.output_grad) if not (g and differentiable(v))]
        if constant:
            ctx.mark_non_differentiable(*constant)
        return values

    @staticmethod
    def backward(ctx, *grads: Optional[Tensor]):
        if torch.is_grad_enabled():  # autograd enables it in a node's backward only for create_graph=True
            raise RuntimeError(
                "A backward with `create_graph=True` ran through the pipeline (a gradient penalty such as WGAN-GP's "
                "or R1, `torch.autograd.grad(..., create_graph=True)`, a Hessian-vector product). The drain runs "
                "each stage's backward on its own rank and sends plain gradients between them: no graph would "
                "join the gradients it returns to the weights of the stages, so a loss built from them would "
                "silently miss its gradient for every backbone weight. Gradients of gradients through a pipelined "
                "backbone are not supported: train such a model with a strategy that keeps it whole ('auto', "
                "'ddp', 'fsdp'), or penalize only layers outside the backbone."
            )
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError(
                "A second backward ran through the pipeline for one call of the backbone (`retain_graph=True`, or "
                "`torch.autograd.grad` of a backbone output before the loss's backward?). "
                "The drain frees each micro-batch's graph and sends its gradients to the other stages once, so each "
                "backbone output can be back-propagated only once: add the losses up and call backward once, or "
                "call the backbone again for a second backward."
            )
        whole = fills_every_leaf(ctx.anchor)  # else torch.autograd.grad or backward(inputs=...): leave .grad alone
        outer, ctx.runner._draining = ctx.runner._draining, run
        try:
            recomputes = any(buffers is not None for buffers in run.buffers)  # which run the layers again
            streams = (
                host_streams(run.host_keyed, partial(ctx.runner._drew, run, ctx.runner._mode()))
                if recomputes
                else nullcontext()
            )
            with ctx.runner._span("drain"), streams:
                input_grads = ctx.runner._drain(run, grads, whole) or [None] * ctx.num_leaves
                if ctx.runner.after_drain is not None and whole:
                    ctx.runner.after_drain()
        except BaseException as error:
            ctx.runner._tell(error)
            raise
        finally:
            ctx.runner._draining = outer
            ctx.runner._undrained.pop(run.call, None)
        return (None, None, None, None, None, *input_grads)
