"""The plain Python attributes a layer's forward writes, so that a recompute sees and leaves what the forward did.

A layer may keep state in plain attributes and change it in its forward: a call counter that anneals a
temperature (``self.calls += 1``, ``self.tau = max(0.3, self.tau * 0.9)``), a running mean kept as a tensor
attribute rather than a buffer. Recomputing a checkpointed micro-batch runs that forward a second time: the
recompute computed with the advanced state, so the micro-batch back-propagated through another function than
the one it ran, and the state advanced twice (1.5e-2 between ``checkpoint="never"`` and ``"always"`` after 5
steps in a probe, the counter at 40 against 20). :class:`AttributeWrites` does for these attributes what
:class:`~lightning_gpipe.engine.checkpoint.ForwardWrites` does for buffers, with which it runs.

Only the modules of other packages than torch are watched: torch's own layers keep their state in buffers
(handled there) and write no attributes in their forward. Per checkpointed micro-batch, each watched module's
attributes are read once (about 1 us a module on CPU-2); a tensor attribute is copied where a forward has
been seen to write it in place (every one in the first forward, once).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

__all__ = ["AttributeWrites", "attributes_kept", "keeps_attributes", "layer_attributes"]

#: What every nn.Module keeps in its ``__dict__`` (parameters, buffers, submodules, hooks, the training flag):
#: the module's machinery, not a layer's own state.
_MACHINERY = frozenset(vars(nn.Module()))
#: An attribute that did not exist before the forward.
_MISSING = object()


def keeps_attributes(module: nn.Module) -> bool:
    """Whether ``module``'s forward may write its plain attributes: a module of another package than torch."""
    return not type(module).__module__.startswith("torch.")


def _watched(stage: nn.Module) -> list[nn.Module]:
    """The modules whose attributes a forward may write."""
    return [m for m in stage.modules() if keeps_attributes(m)]


class AttributeWrites:
    """Which plain attributes the forwards of a stage's modules write, learnt as they run, and their replay."""

    def __init__(self, stage: nn.Module) -> None:
        self._modules = _watched(stage)
        self._in_place: set[tuple[int, str]] = set()  # tensor attributes a forward wrote in place
        self._learned = False

    def _state(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in vars(m).items() if k not in _MACHINERY} for m in self._modules]

    @contextmanager
    def before(self) -> Iterator[dict[tuple[int, str], Any]]:
        """Around the forward of a checkpointed micro-batch: yields, once it ran, the written attributes' values
        before it (:data:`_MISSING` for one the forward created), for :meth:`replayed`."""
        if not self._modules:
            yield {}
            return
        state = self._state()
        copied = {  # the tensors a forward may write in place: every one until a forward was watched
            (j, k): v.detach().clone()
            for j, attributes in enumerate(state)
            for k, v in attributes.items()
            if isinstance(v, Tensor) and (not self._learned or (j, k) in self._in_place)
        }
        versions = {(j, k): v._version for j, a in enumerate(state) for k, v in a.items() if isinstance(v, Tensor)}
        written: dict[tuple[int, str], Any] = {}
        yield written
        for j, (module, attributes) in enumerate(zip(self._modules, state)):
            for k, now in vars(module).items():
                if k in _MACHINERY:
                    continue
                then = attributes.get(k, _MISSING)
                if now is not then:  # rebound: a new number, a new tensor
                    written[(j, k)] = then
                elif isinstance(now, Tensor) and now._version != versions[(j, k)]:  # written in place
                    self._in_place.add((j, k))
                    if (j, k) in copied:  # else learnt now: this once, the recompute starts from its current value
                        written[(j, k)] = copied[(j, k)]
            for k in attributes.keys() - vars(module).keys():  # deleted in the forward
                written[(j, k)] = attributes[k]
        self._learned = True

    @contextmanager
    def replayed(self, values: dict[tuple[int, str], Any]) -> Iterator[None]:
        """The recompute: the attributes hold ``values`` (from :meth:`before`) inside, and what they held before
        after."""
        current = {key: self._get(key) for key in values}
        for key, value in values.items():
            self._put(key, value)
        try:
            yield
        finally:
            for key, value in current.items():
                self._put(key, value)

    def _get(self, key: tuple[int, str]) -> Any:
        j, name = key
        value = vars(self._modules[j]).get(name, _MISSING)
        return value.detach().clone() if isinstance(value, Tensor) and key in self._in_place else value

    def _put(self, key: tuple[int, str], value: Any) -> None:
        """Rebind the attribute, or, for a tensor a forward writes in place, write its values in place (so that
        whatever else holds that tensor sees them, as with the forward's own write)."""
        j, name = key
        attributes = vars(self._modules[j])
        now = attributes.get(name, _MISSING)
        if value is _MISSING:
            attributes.pop(name, None)
        elif (
            key in self._in_place
            and isinstance(now, Tensor)
            and isinstance(value, Tensor)
            and (now.shape, now.dtype, now.device) == (value.shape, value.dtype, value.device)
        ):
            # through `.data`, as `restore_buffer` writes: a graph may hold the tensor (`x * self.scale`, recomputed
            # just before), and a write that bumped its version made autograd reject that graph
            now.data.copy_(value)
        else:
            attributes[name] = value


@contextmanager
def attributes_kept(module: nn.Module) -> Iterator[None]:
    """Inside, the forwards of ``module``'s layers may write their plain attributes; afterwards they hold what they
    held before. For the runs that are no training step: the balance profile and the per-sample check, where a call
    counter would otherwise count their extra calls, and only on the rank that made them (the profile runs on global
    rank 0), so that the stages' layers would start apart from one device's.

    Tensor attributes are copies inside, and the originals are bound again afterwards, as
    :func:`~lightning_gpipe.engine.sample_check.probing` does with buffers: an original is never written, so nothing
    that holds it (a graph of the call under way, a tensor that shares its storage) sees a write or a new version.
    A list, dict or set attribute keeps its object and gets its items back (a record appended to, ``self.seen``).
    """
    watched = _watched(module)
    saved = [{k: v for k, v in vars(m).items() if k not in _MACHINERY} for m in watched]
    held = [(v, copy.copy(v)) for attributes in saved for v in attributes.values() if type(v) in (list, dict, set)]
    for m, attributes in zip(watched, saved):
        for k, v in attributes.items():
            if isinstance(v, Tensor):
                vars(m)[k] = v.detach().clone().requires_grad_(v.requires_grad)
    try:
        yield
    finally:
        for m, attributes in zip(watched, saved):
            now = vars(m)
            for k in [k for k in now if k not in _MACHINERY and k not in attributes]:  # made inside
                del now[k]
            now.update(attributes)
        for container, items in held:  # the same object (others may hold it too), with its items as before
            container.clear()
            if isinstance(container, list):
                container.extend(items)
            else:
                container.update(items)


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is data that can travel between stages: numbers, strings, tensors, and containers of them."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, Tensor)):
        return True
    if depth < 4 and isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v, depth + 1) for k, v in value.items())
    return False


def layer_attributes(layers: nn.Module) -> dict[str, dict[str, Any]]:
    """The plain-data attributes of ``layers``' modules of other packages than torch, by module name, tensors on the
    CPU: what a stage sends when the backbone is reassembled after a run, so that a layer's call counter or running
    value comes back as its stage left it (a module of another kind, a function, a file is left where it is)."""
    found: dict[str, dict[str, Any]] = {}
    for name, module in layers.named_modules(remove_duplicate=False):
        if not name or type(module).__module__.startswith("torch."):
            continue
        attributes = {
            k: v.detach().cpu() if isinstance(v, Tensor) else v
            for k, v in vars(module).items()
            if k not in _MACHINERY and _plain(v)
        }
        if attributes:
            found[name] = attributes
    return found
