"""Optimizer state of a partitioned model keyed by parameter name, so that any split (or one device) can load it.

Each rank's optimizer holds its own stage's parameters plus the replicated ones outside the backbone.
A one-device optimizer numbers its parameters 0, 1, 2... in the order it was given them; here the
names stand in for the numbers while state travels between ranks, and the numbering of a one-device
run is rebuilt for the saved file, with ``param_names`` beside it. So the file resumes a one-device
run, and a pipeline of any K maps it back by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.tied import canonical_names

__all__ = [
    "Layout",
    "param_names",
    "named_state",
    "group_names",
    "layout",
    "merge",
    "localize",
    "from_named",
    "local_groups",
]

#: For each param group, the names of its parameters across the whole model, in one-device order.
Layout = list[list[str]]


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def param_names(optimizer: Optimizer, module: nn.Module) -> list[list[str]]:
    """The names (in ``module``) of each param group's parameters on this rank."""
    names = {id(p): n for n, p in module.named_parameters()}
    names.update(canonical_names(module))  # a stage's copy of a tied parameter goes by the whole model's name
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise ValueError(
            "The optimizer holds a parameter that is not in the LightningModule; optimizers must be "
            "built from the module's own parameters (e.g. self.parameters())."
        ) from None


def named_state(optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """This rank's optimizer state with parameter names in place of positions.

    ``group_of`` names every parameter's group, those without state too (plain SGD keeps none; Adam
    none for a parameter that never had a gradient), so that a resume knows they belong there.
    """
    state = optimizer.state_dict()
    names = param_names(optimizer, module)
    flat = [n for group in names for n in group]
    return {
        "groups": [_hyper(g) for g in state["param_groups"]],
        "state": {flat[i]: value for i, value in state["state"].items()},
        "group_of": {name: g for g, group in enumerate(names) for name in group},
    }


def group_names(named: Mapping[str, Any]) -> list[list[str]]:
    """Each param group's parameter names in a :func:`named_state` (what :func:`param_names` said on that stage)."""
    groups: list[list[str]] = [[] for _ in named["groups"]]
    for name, g in named["group_of"].items():
        groups[g].append(name)
    return groups


def layout(local_names: Sequence[list[list[str]]], full_order: Sequence[str]) -> Layout:
    """Each group's parameters over all stages (``local_names`` holds one entry per stage), in model order."""
    position = {name: i for i, name in enumerate(full_order)}
    groups = len(local_names[0])
    if any(len(names) != groups for names in local_names):
        raise ValueError(
            "The stages' optimizers have different numbers of param groups; configure_optimizers must "
            "build the same groups on every stage."
        )
    group_of: dict[str, int] = {}
    for stage, names_of_stage in enumerate(local_names):
        for g, names in enumerate(names_of_stage):
            for name in names:
                if group_of.setdefault(name, g) != g:  # a tied parameter's copies: one per stage
                    raise PipelineError(
                        f"The tied parameter {name!r} is in param group {group_of[name]} on one stage and in group {g} "
                        f"on stage {stage}: its copies would be stepped differently. configure_optimizers must put "
                        "every name of a tied parameter into the same param group."
                    )
    merged = []
    for g in range(groups):
        found = {n for stage in local_names for n in stage[g]}
        merged.append(sorted(found, key=lambda n: position.get(n, len(position))))
    return merged


def merge(parts: Sequence[Mapping[str, Any]], groups_layout: Layout) -> dict[str, Any]:
    """The stages' named states as one optimizer ``state_dict`` numbered like a one-device run's."""
    state: dict[int, Any] = {}
    param_groups = []
    index = 0
    named = {name: value for part in parts for name, value in part["state"].items()}
    for g, names in enumerate(groups_layout):
        ids = list(range(index, index + len(names)))
        param_groups.append({**parts[0]["groups"][g], "params": ids, "param_names": list(names)})
        for i, name in zip(ids, names):
            if name in named:
                state[i] = named[name]
        index += len(names)
    return {"state": state, "param_groups": param_groups}


def localize(
    saved: Mapping[str, Any], optimizer: Optimizer, module: nn.Module, groups_layout: Optional[Layout] = None
) -> dict[str, Any]:
    """The part of a whole-model optimizer ``state_dict`` that this rank's ``optimizer`` holds.

    ``saved`` names its parameters with ``param_names`` (files written by this package), or else is a
    one-device file whose numbering follows ``groups_layout``.
    """
    saved_groups = saved["param_groups"]
    local = param_names(optimizer, module)
    if len(saved_groups) != len(local):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups but this one has "
            f"{len(local)}; resume with the same configure_optimizers."
        )
    state: dict[int, Any] = {}
    groups = []
    position = 0
    for g, (group, names) in enumerate(zip(saved_groups, local)):
        saved_names = group.get("param_names") or (groups_layout[g] if groups_layout else None)
        if saved_names is None or len(saved_names) != len(group["params"]):
            raise ValueError(
                f"Cannot match param group {g} of the checkpoint's optimizer ({len(group['params'])} parameters) "
                "to this model's parameters by name; was it written for another model?"
            )
        by_name = dict(zip(saved_names, group["params"]))
        if group.get("param_names") and any(n not in by_name for n in names):
            by_name = _relative_to_a_submodule(by_name, names) or (
                dict(zip(groups_layout[g], group["params"])) if groups_layout else by_name
            )
        ids = []
        for name in names:
            if name not in by_name:
                raise ValueError(f"The checkpoint's optimizer has no state for parameter {name!r} in group {g}.")
            if by_name[name] in saved["state"]:
                state[position] = saved["state"][by_name[name]]
            ids.append(position)
            position += 1
        groups.append({**_hyper(group), "params": ids})
    return {"state": state, "param_groups": groups}


def _relative_to_a_submodule(by_name: dict[str, int], names: list[str]) -> Optional[dict[str, int]]:
    """``by_name`` under the model's names, when torch saved names relative to one submodule of the model.

    ``Adam(self.backbone.named_parameters())`` on one device saves ``"0.weight"`` for the model's
    ``"backbone.0.weight"``. The prefix is the one under which every parameter of this group is a saved
    name; ``None`` if there is no such prefix or more than one.
    """
    if not names:
        return None
    first = names[0].split(".")
    prefixes = {".".join(first[:i]) + "." for i in range(1, len(first))}
    fits = [p for p in prefixes if all(n.startswith(p) and n[len(p) :] in by_name for n in names)]
    return {fits[0] + k: v for k, v in by_name.items()} if len(fits) == 1 else None


def from_named(named: Mapping[str, Any], order: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """A :func:`named_state` (as a sharded checkpoint stores it) in the form :func:`localize` reads.

    Each group lists the names that ``group_of`` puts in it, with or without state. (Without
    ``group_of``, every group lists every name that has state, and :func:`localize` looks each of its
    own parameters up within its own group, which finds it.) With ``order`` (the model's names in its order),
    each group lists its names in that order: the numbering a one-device optimizer built from
    ``self.parameters()`` gives, so that a one-device run resumes the state by position.
    """
    saved = named.get("state", {})  # a sharded checkpoint drops an empty state
    group_of = named.get("group_of")
    members = (
        [[n for n, g in group_of.items() if g == i] for i in range(len(named["groups"]))]
        if group_of is not None
        else [list(saved)] * len(named["groups"])
    )
    if order is not None:
        position = {name: i for i, name in enumerate(order)}
        members = [sorted(names, key=lambda n: position.get(n, len(position))) for names in members]
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group, names in zip(named["groups"], members):
        ids = list(range(index, index + len(names)))
        state.update({i: saved[n] for i, n in zip(ids, names) if n in saved})
        groups.append({**group, "params": ids, "param_names": list(names)})
        index += len(names)
    return {"state": state, "param_groups": groups}


def local_groups(groups: Sequence[Mapping[str, Any]], module: nn.Module, known: Sequence[str]) -> list[dict[str, Any]]:
    """Param groups that name their parameters (``"params"``: names in the whole model), holding this rank's.

    A name of another stage's parameter is left out; a name that the whole model (``known``) lacks is an
    error, as it is on one device.
    """
    mine = dict(module.named_parameters())
    params = {id(p): p for p in mine.values()}
    mine.update({name: params[i] for i, name in canonical_names(module).items() if i in params})
    known_names = set(known)
    out = []
    for g, group in enumerate(groups):
        unknown = [n for n in group["params"] if n not in mine and n not in known_names]
        if unknown:
            raise ValueError(
                f"Param group {g} names parameters that {type(module).__name__} does not have: {unknown}. "
                "Resume with the model the checkpoint was written for."
            )
        out.append({**group, "params": [mine[n] for n in group["params"] if n in mine]})
    return out
