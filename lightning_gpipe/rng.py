"""Random streams keyed by (seed, call, micro-batch, layer), so that randomness does not depend on the split.

A dropout mask that a layer draws must not depend on which process runs the layer, nor on what ran
before it in that process. So each layer, for each micro-batch of each pipeline call, reseeds the
generators of its device from a hash of those four numbers, and the caller's generator state is put
back afterwards. The same key in the recompute gives the same mask, so nothing needs to be snapshotted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["layer_seed", "isolated_rng", "seed_layer", "mix64"]

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


@contextmanager
def isolated_rng(device: torch.device) -> Iterator[None]:
    """Run a block with the CPU generator (and ``device``'s, on CUDA) put back as it was afterwards.

    ``torch.random.fork_rng`` does the same but warns or forks every visible GPU; here only the stage's
    own device matters.
    """
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)


def seed_layer(seed: int, device: torch.device) -> None:
    """Seed the generators a layer on ``device`` draws from (call inside :func:`isolated_rng`)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()] \
            .manual_seed(seed)
