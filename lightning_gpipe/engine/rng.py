"""Random streams keyed by (seed, call, micro-batch, layer), and the one place random state is saved and restored.

A dropout mask that a layer draws must not depend on which process runs the layer, nor on what ran
before it in that process. So each layer, for each micro-batch of each pipeline call, reseeds the
generators of its device from a hash of those four numbers (and Python's ``random`` and NumPy's global
generator where the layers draw from them, see :class:`HostDraws`), and the caller's generator state is
put back afterwards. The same key in the recompute gives the same mask, so nothing needs to be snapshotted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

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
    "HostDraws",
    "host_streams",
    "HostState",
    "host_state",
    "same_host_state",
    "seed_host",
    "set_host_state",
    "isolated_rng",
    "LayerGenerator",
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


def seed_host(seed: int) -> None:
    """Seed Python's ``random`` and NumPy's global generator for a layer that draws from them (see :class:`HostDraws`);
    the caller keeps their states (:func:`host_state`, :func:`set_host_state`)."""
    random.seed(seed)
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)  # NumPy's legacy seeding takes 32 bits


#: Python's and NumPy's global generator states, as :func:`host_state` reads them.
HostState = tuple[Any, Any]


def host_state() -> HostState:
    """Python's ``random`` and NumPy's global generator states (about 40 us to read on CPU-2, NumPy's most of it)."""
    return random.getstate(), np.random.get_state() if np is not None else None


def set_host_state(state: HostState) -> None:
    random.setstate(state[0])
    if state[1] is not None:
        np.random.set_state(state[1])


def same_host_state(a: HostState, b: HostState) -> bool:
    """Whether nothing drew from Python's or NumPy's global generator between the two reads (or it drew nothing)."""
    if a[0] != b[0]:
        return False
    if a[1] is None or b[1] is None:
        return a[1] is b[1]
    return bool(np.array_equal(a[1][1], b[1][1])) and a[1][2:] == b[1][2:]


class HostDraws:
    """Which of a stage's layers draw from Python's ``random`` or NumPy's global generator, learnt in its first call.

    Layers do draw from them: a LayerDrop written ``if random.random() < p`` (as older Hugging Face encoders did,
    or with ``np.random.uniform``). Unkeyed, such a layer drew, per stage process, from whatever that process had
    drawn before, and its recompute drew another number than its forward, so a checkpointed micro-batch
    back-propagated through another function than the one it ran: losses 0.17-0.33 apart between K and checkpoint
    modes over 6 steps in a probe, without a word. So a stage's first call in each mode (its layers' ``training``
    flags) seeds both generators per layer like torch's (:func:`seed_host`, keyed alike) and watches which layers
    draw; later calls seed them only on a stage where some layer drew. Seeding costs about 5 us per layer and
    micro-batch on CPU-2 (23% of a step of 24 layers 64 wide, M=8), which every other stage is spared; those check
    once per fill or drain that nothing drew (:func:`host_streams`). Where something did, a layer may have started
    drawing only now (its draws in that call came from the process's own state) or another thread of the process
    drew meanwhile (a logger's retry jitter: nothing is wrong). Which one cannot be told apart, so rather than end
    the run the stage warns, saying both, and seeds per layer from then on (:meth:`draws_from_now_on`).
    """

    def __init__(self) -> None:
        #: by the mode of the stage's layers (each one's ``training`` flag): the layers that drew in its first call
        self._drawing: dict[tuple[bool, ...], list[int]] = {}

    def learning(self, mode: tuple[bool, ...]) -> bool:
        """Whether this mode's first call is still to come: it seeds every layer and watches which draw."""
        return mode not in self._drawing

    def keyed(self, mode: tuple[bool, ...]) -> bool:
        """Whether a call in this mode seeds Python's and NumPy's generators per layer."""
        return bool(self._drawing.get(mode, True))

    def learnt(self, mode: tuple[bool, ...], drawing: list[int]) -> None:
        self._drawing[mode] = sorted(set(drawing))

    def drawing(self, mode: tuple[bool, ...]) -> list[int]:
        """The layers (by index) seen drawing in this mode's first call."""
        return self._drawing.get(mode, [])

    def draws_from_now_on(self, mode: tuple[bool, ...], layers: list[int]) -> bool:
        """Seed every one of ``layers`` per layer in this mode from now on; whether that is news (say it once)."""
        news = not self.keyed(mode)
        self._drawing[mode] = sorted(set(layers))
        return news


@contextmanager
def host_streams(keyed: bool, drew: Callable[[], None]) -> Iterator[None]:
    """Around a stage's fill, or a drain that recomputes: Python's and NumPy's generators as the caller left them.

    ``keyed``: the layers seed them (:func:`seed_host`), and they are put back afterwards. Otherwise nothing should
    draw from them: where something did, ``drew()`` is called and they are left as they are (another thread of the
    process may have drawn: its draws stand, see :class:`HostDraws`). Read once around the whole call rather than
    per micro-batch, as :func:`isolated_rng` keeps torch's: no layer draws from them between micro-batches.
    """
    before = host_state()
    try:
        yield
    except BaseException:
        if keyed:
            set_host_state(before)
        raise
    if keyed:
        set_host_state(before)
    elif not same_host_state(before, host_state()):
        drew()


class LayerGenerator:
    """A generator a layer holds, of any of the kinds layers draw from, behind torch's ``get_state``/``set_state``."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def get_state(self) -> Any:
        g = self.generator
        if isinstance(g, torch.Generator):
            return g.get_state()
        if isinstance(g, random.Random):
            return g.getstate()
        if isinstance(g, np.random.RandomState):
            return g.get_state()
        return g.bit_generator.state  # a NumPy Generator (np.random.default_rng)

    def set_state(self, state: Any) -> None:
        g = self.generator
        if isinstance(g, torch.Generator):
            g.set_state(state)
        elif isinstance(g, random.Random):
            g.setstate(state)
        elif isinstance(g, np.random.RandomState):
            g.set_state(state)
        else:
            g.bit_generator.state = state


def _is_generator(value: Any) -> bool:
    if isinstance(value, torch.Generator):
        return True
    if isinstance(value, random.Random):
        return not isinstance(value, random.SystemRandom)  # the OS's entropy: no state to put back
    return np is not None and isinstance(value, (np.random.Generator, np.random.RandomState))


def layer_generators(module: nn.Module) -> list[LayerGenerator]:
    """The generators that ``module`` and its submodules hold as attributes (a noise layer's own): a
    ``torch.Generator``, a ``random.Random``, a NumPy ``Generator`` (``np.random.default_rng``) or ``RandomState``.

    The random streams of :func:`seed_layer` cover the global generators only. A layer that draws from a
    generator of its own would draw again wherever the pipeline runs it more than the training does: in a
    recompute (4.5e-3 off one device after 4 steps with ``checkpoint="always"``), in the balance profile and in the
    per-sample check. Those put these generators' states back (:func:`generators_kept`, and
    :class:`~lightning_gpipe.engine.checkpoint.ForwardWrites` for the recompute).
    """
    found: dict[int, LayerGenerator] = {}
    for m in module.modules():
        for value in vars(m).values():
            if _is_generator(value):
                found.setdefault(id(value), LayerGenerator(value))
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
