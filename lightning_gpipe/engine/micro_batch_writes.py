"""Layers whose training forward moves their own state, found at the first training call and named.

A layer that writes a buffer or a plain attribute in its forward (a running mean it subtracts, a call counter that
anneals a temperature, ``spectral_norm``'s power iteration, a quantization observer, an InstanceNorm's running
statistics) runs once per micro-batch in a pipeline. With ``chunks > 1`` its state then moves ``chunks`` times a batch
where one device moves it once, and what the layer computes from it differs from one device, as BatchNorm's does.
BatchNorm had a warning at setup; such a layer had none: an outside tester's running-mean layer ended 7.8e-3 off
one device in the loss after 4 steps (its counter at 16 against 4) without a word.

So each stage watches the second micro-batch of its first training call that is cut into two or more: a layer whose
state holds other values after that forward than before it is named once, in a warning on the rank that holds it.
The second micro-batch, not the first, so that a cache built at the first call (a rotary embedding's table) and
then kept is not taken for state that moves; values, not identities, so that a cache rebuilt alike each call is
not either. BatchNorm (its own warning) and this package's layers made for micro-batches (``DeferredBatchNorm``) are
left out. The cost: one copy of the stage's buffers and layer attributes, once.

The same holds for a layer whose backward counts over the batch: an embedding built with ``scale_grad_by_freq=True``
divides each token's gradient by its count, which each micro-batch takes over its own tokens. Its settings say so,
and the strategy names it at setup (:func:`frequency_scaled_embeddings`).

Written here because nothing in torch or Lightning says which layers keep state across calls.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpipe.engine.forward_attributes import _MACHINERY, keeps_attributes

__all__ = ["frequency_scaled_embeddings", "named_state_writes", "watching_state"]

#: What a layer's state is read as: (the layer's index in the backbone, the state's dotted name inside it) -> value.
_Key = tuple[int, str]
#: An attribute that the forward deleted.
_MISSING = object()


def _own(module: nn.Module) -> bool:
    """A module whose state moving per micro-batch is known and handled elsewhere."""
    return isinstance(module, _BatchNorm) or type(module).__module__.startswith("lightning_gpipe.")


def _snapshot(value: Any) -> Any:
    """A copy to compare with later: a tensor's values, a container's items, else the object itself."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple, dict, set)):
        try:
            return copy.copy(value)
        except Exception:  # an odd container: compared by identity
            return value
    return value


def _moved(now: Any, then: Any) -> bool:
    """Whether ``now`` holds other values than the snapshot ``then``."""
    if isinstance(now, Tensor) or isinstance(then, Tensor):
        if not (isinstance(now, Tensor) and isinstance(then, Tensor)):
            return True
        return now.shape != then.shape or now.dtype != then.dtype or not torch.equal(now.detach(), then)
    if now is then:
        return False
    try:
        return bool(now != then)
    except Exception:  # a comparison that cannot answer (containers of tensors): only a rebinding counts
        return True


def _state(layers: list[tuple[int, nn.Module]]) -> dict[_Key, Any]:
    state: dict[_Key, Any] = {}
    for index, layer in layers:
        for path, module in layer.named_modules():
            if _own(module):
                continue
            prefix = f"{path}." if path else ""
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    state[(index, prefix + name)] = _snapshot(buffer)
            if not keeps_attributes(module):  # torch's layers keep their state in buffers
                continue
            for name, value in vars(module).items():
                if name not in _MACHINERY and not isinstance(value, nn.Module):
                    state[(index, prefix + name)] = _snapshot(value)
    return state


def _current(layers: dict[int, nn.Module], key: _Key) -> Any:
    index, dotted = key
    path, _, name = dotted.rpartition(".")
    try:
        module = layers[index].get_submodule(path) if path else layers[index]
    except AttributeError:  # a submodule the forward removed: its state is gone
        return _MISSING
    buffer = module._buffers.get(name)
    return buffer if buffer is not None else vars(module).get(name, _MISSING)


@contextmanager
def watching_state(layers: list[tuple[int, nn.Module]]) -> Iterator[dict[int, list[str]]]:
    """Around one training forward of ``layers`` (``(index in the backbone, layer)``): yields, filled once it ran,
    the layers whose state holds other values after it, by index, with the names of what moved."""
    before = _state(layers)
    moved: dict[int, list[str]] = {}
    yield moved
    by_index = dict(layers)
    for key, then in before.items():
        if _moved(_current(by_index, key), then):
            moved.setdefault(key[0], []).append(key[1])


def named_state_writes(moved: dict[int, list[str]], layers: list[tuple[int, nn.Module]], chunks: int) -> str:
    """The warning for the layers in ``moved`` (see :func:`watching_state`)."""
    kinds = dict(layers)
    shown = "; ".join(
        f"layer {index} ({type(kinds[index]).__name__}): " + ", ".join(f"`{name}`" for name in names)
        for index, names in sorted(moved.items())
    )
    return (
        f"These layers of the backbone write their own state in a training forward ({shown}). The pipeline runs each "
        f"layer once per micro-batch, so with chunks={chunks} that state moves {chunks} times a batch where one device "
        "moves it once, and what the layer computes from it differs from a one-device run, as BatchNorm's running "
        "statistics do. GPipeStrategy(chunks=1) (GPipe(..., chunks=1)) gives the one-device result; otherwise make "
        "the state move once per batch (from a hook such as `on_train_batch_end`)."
    )


def frequency_scaled_embeddings(module: nn.Module) -> list[str]:
    """The names of ``module``'s embeddings built with ``scale_grad_by_freq=True``.

    Their backward divides each token's gradient by how often the token occurs in the batch: in a pipeline each
    micro-batch counts its own tokens, so with ``chunks > 1`` the gradient differs from one device's (an outside
    tester: 1.2e-3 off in the embedding after 4 steps at K=2, chunks=4). The forward is per sample, so the per-sample
    check cannot see it; their settings can.
    """
    kinds = (nn.Embedding, nn.EmbeddingBag)
    return [name for name, m in module.named_modules() if isinstance(m, kinds) and m.scale_grad_by_freq]
