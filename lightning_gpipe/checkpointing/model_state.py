"""Whole-model state from a partitioned pipeline: gather the stages' tensors, reassemble the Sequential."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_gpipe.engine.forward_attributes import layer_attributes
from lightning_gpipe.engine.partition import layer_names
from lightning_gpipe.engine.pipe import GPipe
from lightning_gpipe.engine.stage_copy import Gather, StageCopy, retie

__all__ = [
    "meta_state_allowed",
    "refuse_meta_state",
    "check_keys",
    "full_keys",
    "gather_state_dict",
    "local_state_dict",
    "merge_backbone",
    "reassemble",
    "reassemble_copy",
]


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}


def gather_state_dict(pipe: GPipe) -> Optional[dict[str, Tensor]]:
    """The full Sequential's ``state_dict`` (keys ``"<layer>.<name>"``, on the CPU) on the first stage; ``None``
    on the others. Collective over the pipeline: only tensors travel, never modules (modules with hook
    closures cannot be pickled)."""
    with pipe.stage_state():
        own = _cpu(pipe.state_dict())
    doing = "a gather of every stage's state for the whole model (a checkpoint's: `trainer.save_checkpoint`)"
    parts = pipe.gather(own, to_all=False, doing=doing)
    if parts is None:
        return None
    return {k: v for part in parts for k, v in part.items()}


def merge_backbone(
    local: dict[str, Any], backbone: dict[str, Any], prefix: str, module: Optional[nn.Module] = None
) -> dict[str, Any]:
    """``local`` (one stage's module state) with its backbone entries replaced by the whole ``backbone``'s.

    The backbone's entries go where the stage's were, in layer order, so the keys come in the order a
    one-device ``state_dict`` has them. A stage without state of its own in the backbone (its layers
    hold only activations) has no entry that marks the place: then ``module`` (the model ``local``
    came from) tells where the backbone sits among its submodules; without it, the backbone goes last.
    """
    rest = {prefix + k: v for k, v in backbone.items()}
    if not any(key.startswith(prefix) for key in local):
        at = _backbone_slot(list(local), prefix, module) if module is not None else len(local)
        keys = list(local)
        return {**{k: local[k] for k in keys[:at]}, **rest, **{k: local[k] for k in keys[at:]}}
    merged: dict[str, Any] = {}
    for key, value in local.items():
        if not key.startswith(prefix):
            merged[key] = value
        elif rest:
            merged.update(rest)
            rest = {}
    return merged


def _backbone_slot(keys: list[str], prefix: str, module: nn.Module) -> int:
    """Where the backbone's entries go among ``keys``: before the first entry of a module that a state_dict
    visits after the backbone (it visits modules in pre-order, each module's own tensors first)."""
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    backbone = prefix[:-1]
    if backbone not in order:
        return len(keys)
    for i, key in enumerate(keys):
        owner = key.rpartition(".")[0]
        inside = owner == backbone or owner.startswith(prefix)
        if not inside and order.get(owner, -1) > order[backbone]:
            return i
    return len(keys)


_meta_allowed = 0  # > 0 inside `meta_state_allowed()`


@contextmanager
def meta_state_allowed() -> Iterator[None]:
    """Within, a backbone left on ``meta`` by a sharded run gives its ``state_dict`` (meta entries included), for
    code that knows it gets them: the spawn launcher's hand-back of rank 0's weights, the keys of a Sequential."""
    global _meta_allowed
    _meta_allowed += 1
    try:
        yield
    finally:
        _meta_allowed -= 1


def refuse_meta_state(sequential: nn.Sequential, stage: int, hint: str) -> None:
    """After a sharded run: ``sequential`` (this process's stage trained, the other stages' layers on ``meta``)
    refuses ``state_dict()`` while any of its tensors is on ``meta``.

    ``torch.save`` writes meta tensors without complaint, and loading them into a model only warns (copying
    into a meta tensor is a no-op): a saved "model" would hold nothing of the other stages. Once every tensor
    is real again (loaded with ``assign=True``, say), the state_dict is whole and passes.
    """
    if getattr(sequential, "_lightning_gpipe_refuses_meta", False):
        return
    sequential._lightning_gpipe_refuses_meta = True  # type: ignore[assignment]

    def refuse(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        meta = [k for k, v in state.items() if k.startswith(prefix) and isinstance(v, Tensor) and v.is_meta]
        if meta and not _meta_allowed:
            raise RuntimeError(
                f"state_dict() after a run with state_dict_type='sharded': this process kept only stage {stage}'s "
                f"trained layers, and {len(meta)} tensors of the other stages (e.g. `{meta[0]}`) are on the meta "
                f"device, which holds no values; saved, they would silently lose those layers. {hint}"
            )

    sequential.register_state_dict_post_hook(refuse)


def full_keys(module: nn.Module, pipe: GPipe, prefix: str) -> list[str]:
    """The whole model's ``state_dict`` keys, as one device has them, on one stage of ``module`` (its backbone,
    under ``prefix``, partitioned by ``pipe``)."""
    with meta_state_allowed():  # only the keys: the other stages' layers are on meta
        full = dict.fromkeys(pipe.full_sequential().state_dict(keep_vars=True))
    with pipe.stage_state():
        local = module.state_dict(keep_vars=True)
    return list(merge_backbone(local, full, prefix, module))


def check_keys(expected: list[str], saved: list[str], model: str) -> None:
    """Fail when a checkpoint was written for another model than ``model`` (named in the error).

    Each stage loads only its own layers' entries, so without this check a checkpoint of another
    backbone would load without complaint; every rank checks the whole model's keys, so all fail alike.
    """
    saved_set, expected_set = set(saved), set(expected)
    missing = [k for k in expected if k not in saved_set]
    unexpected = [k for k in saved if k not in expected_set]
    if missing or unexpected:
        raise RuntimeError(
            f"The checkpoint does not fit {model}: missing keys {missing}, unexpected keys {unexpected}. Resume "
            "with the model (and backbone) the checkpoint was written for, or set `strict_loading = False` on the "
            "LightningModule to load the matching entries only."
        )


def local_state_dict(state: dict[str, Any], pipe: GPipe, prefix: str) -> dict[str, Any]:
    """The entries of a full ``state`` that this stage and the replicated rest of the model hold.

    Keys under ``prefix`` (the backbone) belong to a layer: kept when the layer is this stage's.
    """
    own = {pipe.layer_names[i] for i, _ in pipe.local_layers()}
    kept = {}
    for key, value in state.items():
        if key.startswith(prefix):
            layer = key[len(prefix) :].split(".", 1)[0]
            if layer not in own:
                continue
        kept[key] = value
    return kept


def reassemble(pipe: GPipe) -> nn.Sequential:
    """The full Sequential with every stage's trained tensors, on the CPU, on every stage; collective.

    The other stages' layers were moved to ``meta``; they get real storage back and are filled with
    the values gathered from their stages, buffers included (also the non-persistent ones, which a
    ``state_dict`` would leave out). Tied parameters are tied again.
    """
    full = _fill(pipe, pipe.full_sequential(), pipe.local_layers(), pipe.gather)
    pipe.ties.retie(full)  # shared parameters are one Parameter again, as in the user's Sequential
    return full


def reassemble_copy(copy: StageCopy) -> nn.Sequential:
    """The whole Sequential of a :class:`StageCopy` (a weight average's), as :func:`reassemble` does for the pipe."""
    full = _fill(copy, copy.full_sequential(), copy.local_layers(), copy.gather)
    retie(full, copy.ties, copy.stage)
    return full


def _empty_on_cpu(layer: nn.Module) -> None:
    """Give a ``meta`` layer uninitialized CPU storage, also a TorchScript one.

    ``Module.to_empty`` is what this is, but a ``ScriptModule`` refuses it ("not supported on ScriptModules")
    while it accepts the ``_apply`` that ``to_empty`` is built on (and that its ``.to("meta")`` went through).
    """
    if isinstance(layer, torch.jit.ScriptModule):
        layer._apply(lambda t: torch.empty_like(t, device="cpu"))
    else:
        layer.to_empty(device="cpu")


def _fill(
    own_layers: nn.Module, full: nn.Sequential, local: list[tuple[int, nn.Module]], gather: Gather
) -> nn.Sequential:
    """``full`` with the layers that are not in ``local`` given storage and every stage's values; collective.

    Besides the tensors and extra state, each layer comes back with what its stage set during the run: which
    parameters require gradients (a layer frozen or unfrozen during ``fit``), which modules are in training
    mode (one put in eval mode) and the plain-data attributes of its own modules (a call counter), as a one-device
    module holds them after ``fit``.
    """
    # every name of a shared tensor, so that each place of a tie gets filled (then `retie` joins them)
    params = list(own_layers.named_parameters(remove_duplicate=False))
    buffers = own_layers.named_buffers(remove_duplicate=False)
    state: dict[str, Any] = {name: t.detach().cpu() for name, t in [*params, *buffers]}
    state.update(_extra_states(own_layers))
    own = {
        "state": state,
        "requires_grad": {name: p.requires_grad for name, p in params},
        "training": {name: m.training for name, m in own_layers.named_modules(remove_duplicate=False) if name},
        "attributes": layer_attributes(own_layers),  # a call counter, a running value kept in a plain attribute
    }
    parts = gather(own, True) or []
    values, requires_grad, training, attributes = (
        {k: v for part in parts for k, v in part[kind].items()} for kind in own
    )
    indices = {i for i, _ in local}
    with torch.no_grad():
        for index, (layer_name, layer) in enumerate(zip(layer_names(full), full)):
            if index in indices:
                continue
            _empty_on_cpu(layer)
            for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
                key = f"{layer_name}.{name}"
                if key not in values:
                    raise RuntimeError(f"No stage sent {key!r} while reassembling the backbone.")
                tensor.data = values[key]
                if key in requires_grad:
                    tensor.requires_grad_(requires_grad[key])
            for key, module in _extra_state_modules(layer, layer_name):
                if key not in values:
                    raise RuntimeError(f"No stage sent {key!r} while reassembling the backbone.")
                module.set_extra_state(values[key])
            for name, module in layer.named_modules(remove_duplicate=False):
                path = f"{layer_name}.{name}" if name else layer_name
                module.training = training.get(path, module.training)
                vars(module).update(attributes.get(path, {}))
    return full


def _extra_state_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``(state_dict key, submodule)`` for each submodule with extra state of its own (``get_extra_state``).

    Extra state is what a module keeps in its ``state_dict`` besides tensors (a count, a configuration); the
    reassembly moves it as a checkpoint does, or the other stages' layers would come back with their initial one.
    """
    dot = f"{prefix}." if prefix else ""
    return [
        (f"{dot}{name}._extra_state" if name else f"{dot}_extra_state", m)
        for name, m in module.named_modules(remove_duplicate=False)
        if type(m).get_extra_state is not nn.Module.get_extra_state
    ]


def _extra_states(module: nn.Module) -> dict[str, Any]:
    """This stage's extra states under their ``state_dict`` keys (see :func:`_extra_state_modules`)."""
    return {key: m.get_extra_state() for key, m in _extra_state_modules(module)}
