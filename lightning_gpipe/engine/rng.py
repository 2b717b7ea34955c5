"""Random streams keyed by (seed, call, micro-batch, layer), and the one place random state is saved and restored.

A dropout mask that a layer draws must not depend on which process runs the layer, nor on what ran
before it in that process. So each layer, for each micro-batch of each pipeline call, reseeds the
generators of its device from a hash of those four numbers, and the caller's generator state is put
back afterwards. The same key in the recompute gives the same mask, so nothing needs to be snapshotted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

try:
    import numpy as np
except ImportError:  # numpy is optional for torch
    np = None  # type: ignore[assignment]

__all__ = [
    "RandomState",
    "generators_kept",
    "get_rng_state",
    "isolated_rng",
    "layer_generators",
    "layer_seed",
    "mix64",
    "seed_layer",
    "set_rng_state",
]

_MASK64 = (1 << 64) - 1


def mix64(value: int) -> int:
    """splitmix64's finalizer: a cheap bijection of 64-bit integers with good avalanche."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_seed(seed: int, call: int, micro: int, layer: int) -> int:
    """A 63-bit seed for one layer on one micro-batch of one pipeline call.

    >>> layer_seed(0, 0, 0, 0) == layer_seed(0, 0, 0, 0) != layer_seed(0, 0, 0, 1)
    True
    """
    value = seed & _MASK64
    for part in (call, micro, layer):
        value = mix64(value ^ mix64(part & _MASK64))
    return value >> 1


RandomState = dict[str, Any]


def get_rng_state(device: torch.device, everything: bool = False) -> RandomState:
    """The generator state a step draws from: torch's CPU generator and, on CUDA, ``device``'s.

    With ``everything``, Python's ``random`` and NumPy's global generator too (what user code outside
    torch may draw from). Only the one device: collecting every GPU's state would create a CUDA context
    on each of them. Every save and restore of random state in the package goes through here and
    :func:`set_rng_state`; the state is a dict of tensors and plain values, so checkpoints can hold it.
    """
    state: RandomState = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if everything:
        state["python"] = random.getstate()
        if np is not None:
            state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: RandomState, device: torch.device) -> None:
    """Put back a state from :func:`get_rng_state` (the parts it holds)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])


@contextmanager
def isolated_rng(device: torch.device, everything: bool = False) -> Iterator[None]:
    """Run a block with the generators put back as they were afterwards (see :func:`get_rng_state`).

    ``torch.random.fork_rng`` does the same but warns or forks every visible GPU; here only the stage's
    own device matters.
    """
    state = get_rng_state(device, everything)
    try:
        yield
    finally:
        set_rng_state(state, device)


def seed_layer(seed: int, device: torch.device) -> None:
    """Seed the generators a layer on ``device`` draws from (call inside :func:`isolated_rng`)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ].manual_seed(seed)


def layer_generators(module: nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator`` objects that ``module`` and its submodules hold as attributes (a noise layer's own).

    The random streams of :func:`seed_layer` cover torch's default generators only. A layer that draws from a
    generator of its own would draw again wherever the pipeline runs it more than the training does: in a
    recompute (4.5e-3 off one device after 4 steps with ``checkpoint="always"``), in the balance profile and in the
    per-sample check. Those put these generators' states back (:func:`generators_kept`, and
    :class:`~lightning_gpipe.engine.checkpoint.ForwardWrites` for the recompute).
    """
    found: dict[int, torch.Generator] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Generator):
                found.setdefault(id(value), value)
    return list(found.values())


@contextmanager
def generators_kept(module: nn.Module) -> Iterator[None]:
    """Inside, ``module``'s own generators (:func:`layer_generators`) may draw; afterwards they hold their states
    from before."""
    states = [(g, g.get_state()) for g in layer_generators(module)]
    try:
        yield
    finally:
        for g, state in states:
            g.set_state(state)
