"""A sample micro-batch of what a LightningModule feeds its backbone, for profiling; nothing else runs.

``balance="time"`` and ``"memory"`` profile the backbone's layers on one micro-batch of real input.
That input is whatever the user's code makes of a batch before it calls the backbone (a stem, a
reshape), so it is captured by running that code until the call, and no further: the backbone itself
may not fit on one device. Plain PyTorch: the LightningModule is used through its public methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.checkpoint import restore_buffer
from lightning_gpipe.engine.forward_attributes import attributes_kept
from lightning_gpipe.engine.rng import isolated_rng

__all__ = ["NoSampleError", "backbone_input", "backbone_sample", "capture_input", "described", "sample_micro_batch"]


def sample_micro_batch(batch: Any, chunks: int) -> Any:
    """The first micro-batch of ``batch`` cut into ``chunks`` (or fewer, if it is smaller), as fresh tensors.

    Fresh tensors own their memory, so the first layer's saved input is counted at the micro-batch's
    size, not at the size of the batch it was cut from.

    >>> sample_micro_batch(torch.zeros(10, 3), 4).shape
    torch.Size([3, 3])
    """
    first = microbatch.scatter(batch, min(chunks, microbatch.batch_size(batch)))[0]
    return microbatch.map_tensors(lambda t: t.detach().clone().requires_grad_(t.requires_grad), first)


class NoSampleError(ValueError):
    """No sample micro-batch of the backbone's input could be taken (see :func:`backbone_sample`)."""


class _Captured(BaseException):
    # A BaseException, so that a user's `except Exception` between the call and the backbone does not swallow it.
    pass


def capture_input(target: nn.Module, run: Callable[[], Any], owner: Optional[nn.Module] = None) -> Any:
    """The input that ``run()`` passes to ``target``; ``target`` and whatever comes after it do not run.

    This finds what a backbone receives from code around it (a ``training_step``, a stem) without
    running the backbone, which may not fit on one device. What that code changes on its way there is put
    back afterwards (see :func:`_kept`): the random state, the buffers of ``owner`` (say the LightningModule:
    a stem's BatchNorm statistics) and the states of its metrics (a ``torchmetrics`` metric updated before
    the call would otherwise count the batch twice); its ``log`` and ``log_dict`` do nothing meanwhile.
    Returns detached tensors that keep their ``requires_grad``; raises ``LookupError`` if ``run``
    returns without calling ``target``.
    """
    box: dict[str, Any] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        values = (*args, *kwargs.values())
        box["input"] = values[0] if len(values) == 1 else values
        raise _Captured

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with _kept(owner, target), isolated_rng(torch.device("cpu")):
            run()
    except _Captured:
        pass
    finally:
        handle.remove()
    if "input" not in box:
        raise LookupError("the code ran to the end without calling the backbone")
    return microbatch.map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), box["input"])


def _is_metric(module: nn.Module) -> bool:
    # torchmetrics' Metric, recognized by what this module uses of it, so that profiling needs no torchmetrics
    return isinstance(getattr(module, "_defaults", None), dict) and callable(getattr(module, "_copy_state_dict", None))


@contextmanager
def _kept(owner: Optional[nn.Module], target: nn.Module) -> Iterator[None]:
    """Inside: ``owner``'s code runs as usual; after: its buffers (outside ``target``) and metric states are as
    before, and ``owner.log`` / ``owner.log_dict`` (a LightningModule's) logged nothing. Its plain attributes (and
    its layers', outside torch's own) are as before too, and the lists, dicts and sets they hold keep their items: a
    step counter (``self.n += 1``) or a record (``self.seen.append(...)``) written before the backbone call would
    otherwise count the profile, on rank 0 alone.

    A metric's state is its registered states (``_defaults``) with its update count and cached result, the
    parts that ``torchmetrics`` itself saves and restores around a ``forward``.
    """
    if owner is None:
        yield
        return
    inside = {id(b) for b in target.buffers()}
    buffers = [(b, b.detach().clone()) for b in owner.buffers() if id(b) not in inside]
    metrics = [m for m in owner.modules() if _is_metric(m)]
    states = [(m, _metric_state(m)) for m in metrics]
    silenced = [name for name in ("log", "log_dict") if callable(getattr(owner, name, None))]
    for name in silenced:
        setattr(owner, name, _ignore)  # an instance attribute: the class's method is back once it is deleted
    try:
        with attributes_kept(owner):
            yield
    finally:
        for name in silenced:
            delattr(owner, name)

        for buffer, value in buffers:
            restore_buffer(buffer, value)
        for metric, state in states:
            for key, value in state.items():
                setattr(metric, key, value)


def _metric_state(metric: nn.Module) -> dict[str, Any]:
    copy: Callable[[], dict[str, Any]] = getattr(metric, "_copy_state_dict")  # noqa: B009  # typed: a module attribute
    extra = {k: getattr(metric, k) for k in ("_update_count", "_computed") if hasattr(metric, k)}
    return {**copy(), **extra}


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def backbone_sample(
    module: Any, backbone: nn.Module, name: str, chunks: int, first_batch: Optional[tuple[Any, str, str]]
) -> tuple[Any, str]:
    """One micro-batch of what ``module`` feeds its ``backbone`` (the attribute ``name``), and where it came from
    (see :func:`backbone_input`)."""
    whole, origin = backbone_input(module, backbone, name, first_batch)
    return described(sample_micro_batch(whole, chunks), origin)


def backbone_input(
    module: Any, backbone: nn.Module, name: str, first_batch: Optional[tuple[Any, str, str]]
) -> tuple[Any, str]:
    """What ``module`` feeds its ``backbone`` (the attribute ``name``) for a whole batch, and where it came from.

    First choice: ``first_batch``, the first batch of the running stage's dataloader with the step
    that takes it and the loader's name (the strategy finds it), run through the batch-transfer
    hooks and that step (``training_step`` when fitting) until the step calls the backbone.
    Second: ``example_input_array``, run through ``forward``. Nothing after the backbone's input
    runs; see :func:`capture_input`. Raises :class:`NoSampleError` if neither works.
    """
    tried = []
    found = first_batch
    if found is None:
        tried.append("the running stage has no dataloader, or it is empty")
    else:
        batch, step, loader = found
        batch = module.on_after_batch_transfer(module.on_before_batch_transfer(batch, 0), 0)
        try:
            x = capture_input(backbone, lambda: getattr(module, step)(batch, 0), owner=module)
            return x, f"the first batch of the {loader}"
        except Exception as error:
            tried.append(
                f"`{step}` on the first batch of the {loader} did not call `self.{name}` "
                f"({type(error).__name__}: {error})"
            )
    example = module.example_input_array
    if example is None:
        tried.append(f"`{type(module).__name__}.example_input_array` is not set")
    else:

        def forward() -> Any:  # the way Lightning's ModelSummary feeds it
            if isinstance(example, (list, tuple)):
                return module(*example)
            return module(**example) if isinstance(example, dict) else module(example)

        try:
            x = capture_input(backbone, forward, owner=module)
            return x, "`example_input_array`"
        except Exception as error:
            tried.append(f"`forward(example_input_array)` did not call `self.{name}` ({type(error).__name__}: {error})")
    raise NoSampleError(
        "Profiling the backbone (balance='time' or 'memory') needs a sample micro-batch, but none could be taken: "
        + "; ".join(tried)
        + ". Set `self.example_input_array` to an input of `forward` that calls the backbone, "
        "or use balance='params' or an explicit list."
    )


def described(sample: Any, origin: str) -> tuple[Any, str]:
    """``sample`` and what it is: its size and ``origin``, for the log."""
    return sample, f"a micro-batch of {microbatch.batch_size(sample)} samples from {origin}"
