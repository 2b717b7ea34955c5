"""Per-layer costs of a Sequential (parameters, time, memory), measured one layer at a time; plain PyTorch.

The costs feed :func:`lightning_gpipe.engine.partition.balance`. Each layer is moved to the device alone,
run forward and backward on the output of the layer before it, and moved back, so a model far
larger than the device is profiled with one layer and one micro-batch's activations on it at a time.
Nothing is left changed: buffers (BatchNorm's running statistics), ``.grad`` and the random state
are as before.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

from lightning_gpipe.balancing.live_bytes import LiveBytes
from lightning_gpipe.engine import microbatch, structure
from lightning_gpipe.engine.checkpoint import restore_buffer
from lightning_gpipe.engine.forward_attributes import attributes_kept
from lightning_gpipe.engine.layer_errors import one_sample_advice
from lightning_gpipe.engine.rng import generators_kept, isolated_rng
from lightning_gpipe.engine.sample_check import probing
from lightning_gpipe.engine.skip import SkipKey, SkipTracker, find_skips, use_tracker
from lightning_gpipe.engine.stage_input import enter

__all__ = ["COST_KINDS", "LayerCosts", "crossable_at", "profile_layers", "state_bytes"]

#: The measured costs a split can balance, besides an explicit list.
COST_KINDS = ("params", "time", "memory")


@dataclass(frozen=True)
class LayerCosts:
    """What each layer of a Sequential costs; every list has one entry per layer.

    ``time`` is the median over repeats of one forward plus one backward on a micro-batch, in
    seconds. ``memory`` is :attr:`state_bytes` (parameters, gradients, optimizer state) plus
    :attr:`activation_bytes` (what the forward saves for the backward, for one micro-batch).

    The planner (:mod:`lightning_gpipe.balancing.plan`) needs more than a split does, so the profile
    also holds, per layer: ``forward`` and ``backward`` seconds apart (a trimmed mean over the repeats:
    the drop of the slowest and the fastest fifth keeps a shared machine's hiccups out; a recompute
    costs a forward), ``output_bytes`` (the layer's output for one micro-batch: what crosses a stage
    boundary, and its gradient back), ``input_counted`` (bytes of the layer's input that its own
    ``activation_bytes`` count) and ``output_counted`` (bytes of its output it saves itself). The last
    two let a stage's kept memory count its input and output once, wherever the boundary falls.
    ``backward_working`` is the most bytes the layer's backward allocates beyond what the forward left
    (gradients of its intermediate tensors and of its input, a kernel's temporaries; the parameter
    gradients, which a step keeps in ``.grad`` anyway, left out), measured with
    :class:`~lightning_gpipe.balancing.live_bytes.LiveBytes`. ``batch`` is the micro-batch size profiled (0:
    unknown). ``crossable`` says whether each layer's output can leave a stage
    (:func:`~lightning_gpipe.engine.structure.crosses`: an ``nn.LSTM``'s ``(output, (h, c))`` cannot, as its
    ``h`` and ``c`` hold the samples in dim 1), so that an automatic split keeps the next layer with it; at a
    micro-batch of one sample it cannot tell, as ``h`` then has a 1 in dim 0 as well. The extra fields are empty
    in costs built by hand for a split.

    >>> costs = LayerCosts(params=[10, 0], time=[2.0, 1.0], state_bytes=[160, 0], activation_bytes=[40, 40])
    >>> costs.of("memory"), costs.of("params")
    ([200.0, 40.0], [10.0, 0.0])
    """

    params: list[int]
    time: list[float]
    state_bytes: list[int]
    activation_bytes: list[int]
    forward: tuple[float, ...] = ()
    backward: tuple[float, ...] = ()
    output_bytes: tuple[int, ...] = ()
    input_counted: tuple[int, ...] = ()
    output_counted: tuple[int, ...] = ()
    batch: int = 0
    backward_working: tuple[int, ...] = ()
    crossable: tuple[bool, ...] = ()

    @property
    def memory(self) -> list[float]:
        return [float(s + a) for s, a in zip(self.state_bytes, self.activation_bytes)]

    def of(self, kind: str) -> list[float]:
        """The cost vector named ``kind``: ``"params"``, ``"time"`` or ``"memory"``."""
        if kind not in COST_KINDS:
            raise ValueError(f"Unknown cost {kind!r}; choose one of {COST_KINDS}.")
        values = self.memory if kind == "memory" else getattr(self, kind)
        return [float(v) for v in values]


def state_bytes(layer: nn.Module, optimizer_states: float = 2.0) -> int:
    """Bytes of a layer's parameters and buffers, and of a gradient and ``optimizer_states`` states per trainable one.

    The optimizer does not exist yet when the split is chosen (Lightning builds it for the local
    stage only), so its state is assumed: 2 tensors the size of each parameter is Adam and AdamW
    (``exp_avg``, ``exp_avg_sq``); SGD with momentum keeps 1, plain SGD 0.
    """
    total = float(sum(b.numel() * b.element_size() for b in layer.buffers()))
    for p in layer.parameters():
        size = p.numel() * p.element_size()
        total += size * (1 + (1 + optimizer_states) * p.requires_grad)
    return int(total)


def profile_layers(
    module: nn.Sequential,
    sample: Any,
    device: Union[torch.device, str, None] = None,
    *,
    repeats: int = 5,
    optimizer_states: float = 2.0,
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    count: bool = True,
) -> LayerCosts:
    """Measure every layer of ``module`` on ``device`` (default: the CPU), one layer there at a time.

    ``sample`` is the backbone's input for one micro-batch; each layer gets the previous layer's
    output. The layers are swept ``1 + repeats`` times in order, each layer moved to ``device`` for
    its forward plus backward and moved back: the first sweep counts the saved activations and
    warms up, the median of the others is the time. ``context`` wraps each forward (an autocast,
    for mixed precision). A layer that fails raises ``RuntimeError`` naming its index and type.
    ``count=False`` runs the timed sweeps alone (the bytes are then 0): more times for a profile that
    already has the bytes (:func:`~lightning_gpipe.balancing.plan.profile_for_plan`).

    Skip connections (:mod:`lightning_gpipe.engine.skip`) count where the pipeline holds them: a skip's
    bytes are activation memory of the layer that stashes it (kept for its backward) and of the layer
    that pops it (the received tensor), and their gradients are part of both layers' backward times.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"profile_layers measures an nn.Sequential, got {type(module).__name__}.")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be a positive integer, got {repeats!r}.")
    device = torch.device(device) if device is not None else torch.device("cpu")
    times: list[list[float]] = [[] for _ in module]
    forwards: list[list[float]] = [[] for _ in module]
    backwards: list[list[float]] = [[] for _ in module]
    activations = [0] * len(module)
    outputs = [0] * len(module)
    inputs_counted = [0] * len(module)
    outputs_counted = [0] * len(module)
    workings = [0] * len(module)
    crossable = [True] * len(module)
    size = microbatch.batch_size(sample)
    pops = {route.key: route.pop_layer for route in find_skips(module) if route.pop_layer != route.stash_layer}
    # Whole sweeps, not repeats of one layer in a row: each layer then meets the caches and the
    # allocator in the state the layers before it leave, as in training. Sweep 0 counts and warms up.
    with isolated_rng(device, everything=True), generators_kept(module), attributes_kept(module), torch.enable_grad():
        for sweep in range(0 if count else 1, 1 + repeats):
            # a copy: an in-place first layer would write the sample, which every sweep starts from
            x = microbatch.map_tensors(
                lambda t: t.detach().to(device, copy=True).requires_grad_(t.requires_grad), sample
            )
            input_saved = [False] * len(microbatch.tensors(x))  # which inputs the layer before saved (and counted)
            waiting: dict[SkipKey, Tensor] = {}  # skips stashed by earlier layers, as fresh leaves
            for index, layer in enumerate(module):
                try:
                    received = {k: waiting.pop(k) for k, at in pops.items() if at == index and k in waiting}
                    x, measured, input_saved, leaving = _profile_layer(
                        layer, x, input_saved, device, context, received, set(pops), count=sweep == 0
                    )
                    waiting.update({k: t.detach().requires_grad_(t.requires_grad) for k, t in leaving.items()})
                    if index == len(module) - 1:
                        structure.flatten(x)  # the backbone output: what cannot leave a stage cannot leave the pipe
                except Exception as error:
                    # a BatchNorm on one sample: an explicit balance would only move the error to the first step
                    advice = one_sample_advice(error) or (
                        " The pipeline runs every layer on micro-batches too, so a layer that assumes the whole "
                        "batch's size (a reshape to a fixed batch size) fails there as well. Fix the layer, or give "
                        "the split explicitly with `balance`."
                    )
                    raise RuntimeError(
                        f"Profiling layer {index} ({type(layer).__name__}) of the backbone on a micro-batch of {size} "
                        f"sample{'s' * (size != 1)} failed with {type(error).__name__}: {error}.{advice}"
                    ) from error
                if sweep == 0:
                    activations[index] = measured.activation
                    outputs[index] = measured.output
                    inputs_counted[index] = measured.input_counted
                    outputs_counted[index] = measured.output_counted
                    workings[index] = measured.backward_working
                    crossable[index] = structure.crosses(x, size)
                else:
                    times[index].append(measured.forward + measured.backward)
                    forwards[index].append(measured.forward)
                    backwards[index].append(measured.backward)
    params = [sum(p.numel() for p in layer.parameters()) for layer in module]
    states = [state_bytes(layer, optimizer_states) for layer in module]
    return LayerCosts(
        params,
        [statistics.median(t) for t in times],
        states,
        activations,
        forward=tuple(trimmed_mean(t) for t in forwards),
        backward=tuple(trimmed_mean(t) for t in backwards),
        output_bytes=tuple(outputs),
        input_counted=tuple(inputs_counted),
        output_counted=tuple(outputs_counted),
        batch=size,
        backward_working=tuple(workings),
        crossable=tuple(crossable),
    )


def crossable_at(
    module: nn.Sequential, sample: Any, device: Optional[Union[torch.device, str]] = None
) -> tuple[bool, ...]:
    """Whether each layer's output for ``sample`` can leave a stage (:func:`~lightning_gpipe.engine.structure.crosses`),
    from one forward without a graph, in eval mode, each layer moved to ``device`` in turn; the buffers are left as
    they were.

    :func:`profile_layers` decides this on the micro-batch it times. Where that has one sample, a tensor of one sample
    cannot show which dim holds the batch (an LSTM's ``h`` of shape ``(1, 1, H)``): give this a sample of 2.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    size = microbatch.batch_size(sample)
    x = microbatch.map_tensors(lambda t: t.detach().to(device, copy=True), sample)
    flags = []
    with isolated_rng(device, everything=True), generators_kept(module), probing(module), use_tracker(SkipTracker()):
        for layer in module:
            home = _device_of(layer)
            layer.to(device)  # one layer on the device at a time, as profile_layers runs them
            try:
                x = layer(x)
            finally:
                if home is not None:
                    layer.to(home)
            flags.append(structure.crosses(x, size))
    return tuple(flags)


def trimmed_mean(values: list[float], cut: float = 0.2) -> float:
    """The mean without the lowest and the highest ``cut`` share (at least one each from 3 values on).

    >>> trimmed_mean([1.0, 2.0, 3.0, 100.0, 0.0])
    2.0
    """
    ordered = sorted(values)
    drop = max(int(len(ordered) * cut), 1) if len(ordered) >= 3 else 0
    kept = ordered[drop : len(ordered) - drop]
    return statistics.fmean(kept)


class _Measured(NamedTuple):
    """One layer's pass: seconds of the forward and of the backward, and its bytes (see :class:`LayerCosts`)."""

    forward: float
    backward: float
    activation: int
    output: int
    input_counted: int
    output_counted: int
    backward_working: int


def _device_of(layer: nn.Module) -> Optional[torch.device]:
    for tensor in [*layer.parameters(), *layer.buffers()]:
        return tensor.device
    return None


def _storage(t: Tensor) -> tuple[int, int]:
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse or wrapper tensors have no plain storage
        return id(t), t.numel() * t.element_size()


def _profile_layer(
    layer: nn.Module,
    x: Any,
    input_saved: list[bool],
    device: torch.device,
    context: Callable[[], ContextManager[Any]],
    received: dict[SkipKey, Tensor],
    crossing: set[SkipKey],
    count: bool = False,
) -> tuple[Any, _Measured, list[bool], dict[SkipKey, Tensor]]:
    """One forward and backward of one layer on ``device``.

    Returns its output, its times and bytes, which outputs it saved, and the skips it stashed for
    later layers (``crossing`` names the skips whose pop is in another layer; ``received`` are the skips
    this layer pops, from earlier layers). ``count``: the sweep that counts bytes, which also follows the
    backward's allocations (slower, so not a timed sweep).
    """
    home = _device_of(layer)
    buffers = [(b, b.detach().clone()) for b in layer.buffers()]
    layer.to(device)
    try:
        own = {_storage(t)[0] for t in [*layer.parameters(), *layer.buffers()]}
        counted = own | {_storage(t)[0] for t, saved in zip(microbatch.tensors(x), input_saved) if saved}
        saved: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            pointer, size = _storage(t)
            if pointer not in counted:
                saved[pointer] = size
            return t

        tracker = SkipTracker(received, record=True)
        live = LiveBytes() if count else None
        # Only the counting sweep follows what autograd saves. A Python call per saved tensor is no part of a layer's
        # cost in training, and it is large where the host issues the kernels slower than the device runs them: on
        # an H100 it lengthened the sum of the layers' times by up to 10% (AmoebaNet-D) and 29% (a Transformer).
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count else contextlib.nullcontext(),
            use_tracker(tracker),
            live if live is not None else contextlib.nullcontext(),
        ):
            y, leaving, forward, backward, working = _forward_backward(
                layer, x, context, tracker, received, crossing, device, live
            )
        outputs_saved = [_storage(t)[0] in saved for t in microbatch.tensors(y)]
        output_storages = {_storage(t) for t in microbatch.tensors(y)}
        input_storages = {_storage(t) for t in microbatch.tensors(x)}
        output_counted = sum(size for pointer, size in output_storages if pointer in saved)
        input_counted = sum(size for pointer, size in input_storages if pointer in saved)
        for t in [*received.values(), *leaving.values()]:  # held from the stash to the backward, saved or not
            pointer, size = _storage(t)
            if pointer not in counted:
                saved[pointer] = size
    finally:
        for buffer, value in buffers:
            restore_buffer(buffer, value)
        if home is not None:
            layer.to(home)
    y = microbatch.map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), y)
    output = sum(t.numel() * t.element_size() for t in microbatch.tensors(y))
    measured = _Measured(forward, backward, sum(saved.values()), output, input_counted, output_counted, working)
    return y, measured, outputs_saved, leaving


def _forward_backward(
    layer: nn.Module,
    x: Any,
    context: Callable[[], ContextManager[Any]],
    tracker: SkipTracker,
    received: dict[SkipKey, Tensor],
    crossing: set[SkipKey],
    device: torch.device,
    live: Optional[LiveBytes] = None,
) -> tuple[Any, dict[SkipKey, Tensor], float, float, int]:
    """The layer's output and stashed skips, the seconds of its forward and of its backward, and, with ``live``
    following, the most bytes the backward added beyond its start, the parameters' gradients aside (0 without).
    """
    # torch.autograd.grad, not backward(): the parameters' .grad must stay as it was.
    synchronize(device)
    start = time.perf_counter()
    with context():
        y = layer(enter(x))  # an in-place layer works on the leaf, as in the pipeline (see engine.stage_input)
    synchronize(device)
    middle = time.perf_counter()
    leaving = {k: t for k, t in tracker.stashed.items() if k in crossing}
    outputs = [t for t in [*microbatch.tensors(y), *leaving.values()] if t.requires_grad]
    inputs = [*microbatch.tensors(x), *received.values()]
    params = [p for p in layer.parameters() if p.requires_grad]
    wrt = [t for t in inputs if t.requires_grad] + params
    if not (outputs and wrt):
        return y, leaving, middle - start, 0.0, 0
    gradients = [torch.ones_like(t) for t in outputs]
    if live is not None:
        live.mark("backward")
    middle_grads = time.perf_counter()  # the seed gradients are the pipeline's received ones: not the layer's
    computed = torch.autograd.grad(outputs, wrt, gradients, allow_unused=True)
    synchronize(device)
    backward = time.perf_counter() - middle_grads
    if live is None:
        return y, leaving, middle - start, backward, 0
    owned = [g for g in computed[len(wrt) - len(params) :] if g is not None]  # what a step keeps in .grad anyway
    working = live.peak("backward", leave_out=owned) - live.held("backward", leave_out=owned)
    return y, leaving, middle - start, backward, max(working, 0)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work: kernels run asynchronously on accelerators, and a timer must wait for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)
