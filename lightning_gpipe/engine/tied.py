"""Tied weights: a parameter shared by layers on several stages, one copy per stage, gradients summed.

On one device a shared parameter (a language model's embedding and output layer) gets the sum of the
gradients of all its uses. Split over stages, each stage that uses it holds its own copy: the other
stages' layers go to ``meta`` with a placeholder in its place, so that the move cannot touch the copy.
While a drain runs, the gradients that reach a copy are diverted into a buffer (the copy's ``.grad``
keeps the value it had when the drain began, equal on every holder); at the end of the drain the
buffers are summed over the holder stages, averaged over the data-parallel replicas, and added to
``.grad``. So each copy holds the one-device gradient after every backward, whatever Lightning's loop
does around it (gradient accumulation, manual optimization, clipping) and without a hook of its own.
The same collective compares the copies' values, so an optimizer that treats them differently fails
loudly. The canonical name of a tie is its first name in a one-device ``named_parameters()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.engine.distributed import backend_for, new_group
from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.microbatch import as_bits
from lightning_gpipe.engine.partition import layer_names, shared_modules, stage_bounds
from lightning_gpipe.engine.replicas import with_presence
from lightning_gpipe.engine.topology import PipeLayout

__all__ = ["Tie", "TiedCopies", "canonical_names", "find_ties", "one_parameter_per_tie", "refuse_ties_outside", "untie"]


@dataclass(frozen=True)
class Tie:
    """A parameter that several places of the Sequential share.

    ``spots`` are its names (``"<layer>.<path>"``) in one-device order, so ``spots[0]`` is the name a
    one-device ``named_parameters()`` gives it; ``layers`` and ``spot_stages`` say where each spot runs.
    """

    spots: tuple[str, ...]
    layers: tuple[int, ...]
    spot_stages: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.spots[0]

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages that hold a copy, ascending: the first one's copy counts for the whole model."""
        return tuple(sorted(set(self.spot_stages)))

    @property
    def across_stages(self) -> bool:
        return len(self.stages) > 1

    def spot_on(self, stage: int) -> str:
        """The copy's name on ``stage``: its first spot there (what that stage's ``named_parameters()`` says)."""
        return next(s for s, k in zip(self.spots, self.spot_stages) if k == stage)


def _stage_of_layers(balance: list[int]) -> list[int]:
    return [stage for stage, (start, stop) in enumerate(stage_bounds(balance)) for _ in range(start, stop)]


def find_ties(module: nn.Sequential, balance: list[int]) -> list[Tie]:
    """Every parameter with several names in ``module``; raises where a module would have to run on two stages.

    A module object (a layer, or a part of one) with parameters or buffers that appears in layers of
    different stages cannot be split: its state and its code would run in two processes. We refuse it
    rather than copy it (a copy of its buffers would drift apart silently). Its parameters can be shared
    by separate modules, which is what the error suggests. Stateless modules (a shared ``nn.ReLU``) are fine.
    """
    where = _stage_of_layers(list(balance))
    spots: dict[int, list[tuple[int, str]]] = {}
    names = layer_names(module)
    for index, layer in enumerate(module):
        for name, p in layer.named_parameters(remove_duplicate=False):
            spots.setdefault(id(p), []).append((index, f"{names[index]}.{name}"))
    for sub, path, layers in shared_modules(module):
        stages = sorted({where[i] for i in layers})
        if len(stages) > 1:
            itself = [i for i in layers if module[i] is sub]
            if len(itself) == len(layers):
                what = f"Layers {layers} of the Sequential are the same {type(sub).__name__} object"
            elif itself:  # a layer, held inside others too (an autoencoder's decoder holding the encoder layer)
                inside = [i for i in layers if i not in itself]
                what = (
                    f"The {type(sub).__name__} object of layer {itself[0]} is also held inside layer"
                    f"{'s' if len(inside) > 1 else ''} {inside[0] if len(inside) == 1 else inside} of the Sequential"
                )
            else:
                what = f"Layers {layers} share the submodule `{path}` ({type(sub).__name__})"
            raise ValueError(
                f"{what}, but the split (balance={list(balance)}) puts them on stages {stages}: one module cannot run "
                "on two stages. Keep them on one stage with `balance`, or use a separate module for each place and "
                "share only the parameters (e.g. `second.weight = first.weight`): parameters shared across stages "
                "are kept tied by the pipeline."
            )
    return [
        Tie(tuple(n for _, n in places), tuple(i for i, _ in places), tuple(where[i] for i, _ in places))
        for places in spots.values()
        if len(places) > 1
    ]


def _set_parameter(module: nn.Module, spot: str, value: nn.Parameter) -> None:
    path, _, attr = spot.rpartition(".")
    setattr(module.get_submodule(path), attr, value)


def untie(module: nn.Sequential, ties: list[Tie], stage: int) -> None:
    """Put a placeholder at every spot of a tie in another stage's layer.

    Moving those layers to ``meta`` then leaves this stage's copy alone, whatever ``Module.to`` does
    with shared tensors (``torch.__future__`` can make it swap them in place).
    """
    for tie in ties:
        original = module.get_parameter(tie.name)
        for spot, where in zip(tie.spots, tie.spot_stages):
            if where != stage:
                _set_parameter(
                    module, spot, nn.Parameter(torch.empty_like(original, device="meta"), original.requires_grad)
                )


@contextmanager
def one_parameter_per_tie(module: nn.Module, ties: list[Tie], stage: int) -> Iterator[None]:
    """Within, every spot of each tie holds one Parameter, as on one device; the spots are put back at the exit.

    For listings of the whole model (``GPipe.all_layers``, while ``configure_optimizers`` runs), where each spot
    in another stage's layer holds a placeholder of its own (:func:`untie`): ``named_parameters()`` listed a tie once
    per stage holding it and once per placeholder, so a count over the model was too large (a learning rate scaled
    by it, silently off one device) and a param group selected by name got the copy under another name on the
    stages holding a later spot (refused as groups that differ). Here every spot holds this stage's copy (or, where
    it holds none, the first spot's placeholder, which the optimizers drop), so the tie is listed once, under its
    one-device name, on every stage.
    """
    swapped: list[tuple[str, nn.Parameter]] = []
    try:
        for tie in ties:
            kept = module.get_parameter(tie.spot_on(stage) if stage in tie.stages else tie.name)
            for spot in tie.spots:
                current = module.get_parameter(spot)
                if current is not kept:
                    swapped.append((spot, current))
                    _set_parameter(module, spot, kept)
        yield
    finally:
        for spot, parameter in reversed(swapped):
            _set_parameter(module, spot, parameter)


def _checksum(t: Tensor) -> Tensor:
    """The sum of ``t``'s bits: copies that an optimizer stepped apart differ in value, and the sum tells.

    Not position-weighted like a batch fingerprint (nothing reorders a parameter), so it needs no
    parameter-sized temporaries: it runs after every drain (36 ms for 12.8M floats on CPU-2, against
    364 ms for a weighted sum).
    """
    return as_bits(t).sum(dtype=torch.int64)


def _refuse_sparse_ties(module: nn.Sequential, ties: list[Tie]) -> None:
    """Raise where a tie across stages is the weight of a sparse embedding: its copies' gradients are summed in a
    dense buffer (:meth:`TiedCopies.after_drain`), which a sparse gradient cannot join. Every rank decides alike,
    before any step, instead of one rank failing in the sum while the others wait in it."""
    for tie in ties:
        for spot in tie.spots:
            where = spot.rpartition(".")[0]
            owner = module.get_submodule(where)
            if isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and owner.sparse:
                raise ValueError(
                    f"The tied parameter `{tie.name}` (also `{'`, `'.join(tie.spots[1:])}`) is the weight of a sparse "
                    f"embedding (`{where}`, sparse=True), and its copies on stages {list(tie.stages)} sum their "
                    "gradients in a dense buffer, which a sparse gradient cannot join. Make the embedding dense "
                    "(`sparse=False`), or, where the layers allow, a balance that keeps the tied layers on one stage."
                )


class TiedCopies:
    """This stage's copies of the parameters tied across stages, and the groups their gradients are summed over.

    Construction is collective over the job: it creates one process group per set of holder stages,
    spanning those stages of every replica, in the same order on every rank, and gives every copy the
    first holder's value. The engine calls :meth:`after_drain` at the end of every drain.

    With replicas, one all-reduce over that group does both sums at once: the holder stages' (a tie)
    and the replicas' (data parallelism), divided by the number of replicas. So the copies are left
    out of :class:`~lightning_gpipe.engine.replicas.GradientSync` (see :meth:`excluded`), which would
    otherwise average their gradients before the other stages' share had arrived.
    """

    def __init__(
        self, module: nn.Sequential, ties: list[Tie], stage: int, layout: PipeLayout, rank: int, device: torch.device
    ) -> None:
        self.ties, self.stage, self.replicas = ties, stage, layout.num_replicas
        self.prefix = ""  # how error messages name the Sequential ("backbone."), set by the owner
        _refuse_sparse_ties(module, [t for t in ties if t.across_stages])
        self.local: list[tuple[Tie, nn.Parameter]] = []
        self._groups: list[tuple[list[int], Optional[dist.ProcessGroup], list[tuple[Tie, nn.Parameter]]]] = []
        backend = backend_for(device)
        for stages in sorted({t.stages for t in ties if t.across_stages}):
            ranks = sorted(pipeline[s] for pipeline in layout.pipelines for s in stages)
            group = new_group(ranks, backend)  # collective: every rank, same order
            if group is not None:
                copies = [(t, module.get_parameter(t.spot_on(stage))) for t in ties if t.stages == stages]
                self._groups.append((ranks, group, copies))
                self.local.extend(copies)
        self._pending: dict[int, Optional[Tensor]] = {id(p): None for _, p in self.local}
        self._hooks = [p.register_hook(self._diverter(id(p))) for _, p in self.local]
        with torch.no_grad():
            for ranks, group, copies in self._groups:
                for _, p in copies:
                    dist.broadcast(p.data, src=ranks[0], group=group)

    def _diverter(self, key: int) -> Callable[[Tensor], Tensor]:
        def divert(grad: Tensor) -> Tensor:
            pending = self._pending[key]
            self._pending[key] = grad if pending is None else pending + grad
            return torch.zeros_like(grad)  # .grad keeps its value from the drain's start, equal on every holder

        return divert

    def excluded(self) -> set[int]:
        """``id``s of the copies: their replica average is part of :meth:`after_drain`."""
        return {id(p) for _, p in self.local}

    def counted_elsewhere(self) -> list[nn.Parameter]:
        """This stage's copies that an earlier stage also holds: whole-model counts (norm, size) skip them."""
        return [p for t, p in self.local if t.stages[0] != self.stage]

    def canonical_names(self) -> dict[str, str]:
        """This stage's name of each copy -> the whole Sequential's (one-device) name, where they differ."""
        return {t.spot_on(self.stage): t.name for t, _ in self.local if t.spot_on(self.stage) != t.name}

    def after_drain(self) -> None:
        """Check that the copies are equal, then add the sum of the drain's gradients over all holders to each."""
        for ranks, group, copies in self._groups:
            sums = torch.stack([_checksum(p) for _, p in copies])
            everyone = [torch.empty_like(sums) for _ in ranks]
            dist.all_gather(everyone, sums, group=group)
            for j, (tie, _) in enumerate(copies):
                if any(bool(other[j] != everyone[0][j]) for other in everyone):
                    self._diverged(tie, ranks, [int(other[j]) for other in everyone])
            params = [p for _, p in copies]
            flat = with_presence([self._pending[id(p)] for p in params], params)  # None where no holder has one
            dist.all_reduce(flat, group=group)
            if self.replicas > 1:
                flat.div_(self.replicas)
            offset = 0
            used = flat[-len(copies) :].tolist()
            for (_, p), anywhere in zip(copies, used):
                total = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                self._pending[id(p)] = None
                if not anywhere:
                    continue
                if p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.add_(total)

    def _diverged(self, tie: Tie, ranks: list[int], sums: list[int]) -> None:
        pipe = len(ranks) // self.replicas
        odd = sorted({f"stage {tie.stages[i % pipe]}" for i, s in enumerate(sums) if s != sums[0]})
        names = ", ".join(f"`{self.prefix}{s}`" for s in tie.spots)
        raise PipelineError(
            f"The copies of the tied parameter `{self.prefix}{tie.name}` ({names}) on stages {list(tie.stages)} "
            f"differ: {', '.join(odd)} disagree(s) with stage {tie.stages[0]}. On one device it is one tensor, so "
            "every stage must update its copy alike. Usually an optimizer treats one copy differently because it was "
            f"configured by parameter name (on stage {tie.stages[-1]} it is called "
            f"`{self.prefix}{tie.spot_on(tie.stages[-1])}`): give all of its names the same param group and "
            "hyperparameters, and change its value on every stage or on none."
        )

    def retie(self, module: nn.Sequential) -> None:
        """Make every tie one Parameter again in the reassembled ``module``, as the user's Sequential had it:
        this stage's copy where it holds one (the user's own object), else the parameter at the first spot."""
        copies = {t.name: p for t, p in self.local}
        for tie in self.ties:
            shared = copies[tie.name] if tie.name in copies else module.get_parameter(tie.name)
            for spot in tie.spots:
                _set_parameter(module, spot, shared)

    def close(self) -> None:
        """Take the hooks off the copies and shut the groups down."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for _, group, _ in self._groups:
            if group is not None:
                dist.destroy_process_group(group)
        self._groups.clear()


def canonical_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> its one-device name in ``module``, for the tied copies of every pipeline inside it."""
    names: dict[int, str] = {}
    for prefix, sub in module.named_modules():
        copies = getattr(sub, "ties", None)
        if isinstance(copies, TiedCopies):
            for tie, p in copies.local:
                names[id(p)] = f"{prefix}.{tie.name}" if prefix else tie.name
    return names


def refuse_ties_outside(module: nn.Module, backbone: nn.Module, prefix: str) -> None:
    """Raise if a parameter of ``backbone`` (at ``prefix``) is also used outside it.

    Refused rather than supported: the layers outside the backbone are replicated and compute the same
    gradient on every rank (the loss runs everywhere), while the backbone's share exists only on the
    stage that holds the layer. Adding them up would need the gradient of each use apart, and a stage
    without the layer would have to keep and update a copy it never uses in the pipeline. Moving the
    layer into the Sequential makes it an ordinary tie across stages, which is exact.
    """
    attribute = prefix.rstrip(".")
    for name, sub in module.named_modules(remove_duplicate=False):
        if sub is backbone and name != attribute:  # the parameter check below would blame a tie of its first layer
            raise ValueError(
                f"`{name}` is the backbone itself: `{name}` and `{attribute}` are one nn.Sequential under two names "
                f"(an alias). The gpipe strategy puts the pipeline in `{attribute}`'s place during a fit, and a call "
                f"through `{name}` would run the whole Sequential outside it, on every stage. Keep one name: drop the "
                f'alias, or name the Sequential once as `{name}` and pass GPipeStrategy(backbone="{name}").'
            )
    inside = {id(p): name for name, p in backbone.named_parameters(remove_duplicate=False)}
    for name, p in module.named_parameters(remove_duplicate=False):
        if not name.startswith(prefix) and id(p) in inside:
            raise ValueError(
                f"The parameter `{name}` outside the backbone is the same tensor as `{prefix}{inside[id(p)]}` inside "
                "it. Layers outside the backbone are replicated on every stage, so the gpipe strategy cannot keep "
                f"that tie. Move the layer that uses `{name}` into the `{prefix.rstrip('.')}` Sequential (ties "
                "between its layers are kept across stages), or give it a parameter of its own."
            )


def keep_stage(
    holder: nn.Module, module: nn.Sequential, balance: list[int], stage: int, device: Optional[torch.device] = None
) -> list[Tie]:
    """Register ``stage``'s layers of ``module`` on ``holder`` under their names in ``module`` (:func:`layer_names`),
    and move the others to ``meta``.

    Tied parameters are untied first, so this stage's copies stay real (:func:`untie`); the ties found are
    returned. The stage's layers move to ``device`` when it is given. Both ``GPipe`` and a weight average's
    ``StageCopy`` cut a Sequential this way, so their tensors pair one to one.
    """
    start, stop = stage_bounds(balance)[stage]
    ties = find_ties(module, balance)  # raises if one module object would run on two stages
    untie(module, ties, stage)  # before the move to meta, which must not touch this stage's copies
    for index, (name, layer) in enumerate(zip(layer_names(module), module)):
        if start <= index < stop:
            holder.add_module(name, layer if device is None else layer.to(device))
        else:
            layer.to("meta")  # frees the memory of other stages' layers, even if the caller keeps references
    return ties
