"""Copies of the backbone during a pipelined fit: weight averages' copies cut like the pipe, plain copies kept whole.

Weight-averaging callbacks (``StochasticWeightAveraging``, ``EMAWeightAveraging``, any ``WeightAveraging``) and
an ``AveragedModel`` the module makes in ``__init__`` copy the whole model before the pipe is built, and pair
the copy's tensors with the live module's one by one. Each stage's live module lists its own stage's layers,
so the copy's backbone is cut alike (:class:`~lightning_gpipe.engine.stage_copy.StageCopy`): each stage
averages its own layers, exactly as one device would, and the strategy's ``teardown`` reassembles them.

A plain copy of the backbone outside it (a momentum encoder's target, a frozen teacher: the same layers and
shapes) is held whole by every stage; code that updates it from ``self.backbone.parameters()`` during a fit
would see one stage, so the strategy compares the copies and refuses where they part (:func:`mirror_apart`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_gpipe._lightning import averaged_copies
from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine.pipe import GPipe
from lightning_gpipe.engine.stage_copy import Gather, StageCopy

__all__ = ["CutCopies", "cut_copies", "mirror_apart"]


@dataclass
class CutCopies:
    """What :func:`cut_copies` did."""

    #: each cut copy's owner, attribute and cut, to reassemble in teardown
    copies: list[tuple[nn.Module, str, StageCopy]]
    #: the plain copies of the backbone outside it, by path: every stage holds them whole and must keep them one
    mirrors: list[str]
    #: whether a copy inside the module was cut (its tensors now differ by stage: the outer layers' list changes)
    inside_the_module: bool


def cut_copies(
    trainer: "pl.Trainer",
    module: nn.Module,
    pipe: GPipe,
    owner_of: Callable[[nn.Module], tuple[nn.Module, str]],
    deferred_chunks: Optional[int],
    gather: Gather,
) -> CutCopies:
    """Cut every weight average's copy of the backbone like ``pipe``; find the plain copies of it.

    ``owner_of`` finds the backbone's owner and attribute in a model (a callback's copy of the whole module);
    ``deferred_chunks``: the chunks of ``deferred_batch_norm=True``, whose conversion the copies need too (the
    same buffers as the live backbone's, to pair with them), or ``None``; ``gather`` is the pipe's (see
    :class:`StageCopy`).
    """
    copies: list[tuple[nn.Module, str, StageCopy]] = []

    def cut(owner: nn.Module, name: str, sequential: nn.Sequential) -> StageCopy:
        if deferred_chunks is not None:
            DeferredBatchNorm.convert_deferred_batch_norm(sequential, deferred_chunks)
        stage_copy = StageCopy(sequential, pipe.balance, pipe.stage, gather)
        setattr(owner, name, stage_copy)
        copies.append((owner, name, stage_copy))
        return stage_copy

    fresh = trainer.state.fn == TrainerFn.FITTING
    for callback, copy in averaged_copies(trainer):
        owner, name = owner_of(copy)
        sequential = getattr(owner, name)
        if isinstance(sequential, StageCopy):  # a failed run could not reassemble it
            sequential = sequential.full_sequential()
        cut(owner, name, sequential)
        _pair_copy(callback, copy, module, fresh=fresh)
    found = _copies_of_the_backbone(module, pipe) if pipe.group is not None else []
    averages = [path for path, m in module.named_modules() if isinstance(m, AveragedModel)]
    mirrors: list[str] = []
    for path, sequential in found:
        average = next((a for a in averages if path.startswith(a + ".")), None)
        if average is None:  # a plain copy: every stage holds it whole, and must keep it one (see mirror_apart)
            mirrors.append(path)
            continue
        # in an AveragedModel of the module's own (an EMA made in __init__), the copy pairs with the model of
        # `update_parameters`, the backbone: cut alike, each stage averages its own layers. Made equal to the first
        # stage's whole copy before (as a layer outside the backbone), it leaves those layers now.
        parent, _, name = path.rpartition(".")
        stage_copy = cut(module.get_submodule(parent), name, sequential)
        _pair_copy(f"the AveragedModel `{average}`", stage_copy, pipe, fresh=False)
    return CutCopies(copies, mirrors, inside_the_module=len(mirrors) < len(found))


def _layer_shapes(sequential: nn.Sequential) -> list[tuple[type, list[torch.Size]]]:
    """Each layer's type and the shapes of its parameters and buffers: what a copy of a Sequential shares with it."""
    return [(type(layer), [t.shape for t in [*layer.parameters(), *layer.buffers()]]) for layer in sequential]


def _copies_of_the_backbone(module: nn.Module, pipe: GPipe) -> list[tuple[str, nn.Sequential]]:
    """The nn.Sequentials of ``module`` outside the backbone with its layers and shapes (``copy.deepcopy(
    self.backbone)``): a momentum encoder's target, a frozen teacher, the copy inside an ``AveragedModel`` (where
    ``update_parameters`` pairs its tensors one by one with the live backbone's, which lists one stage's); by path."""
    whole = _layer_shapes(pipe.full_sequential())
    return [
        (path, sub)
        for path, sub in module.named_modules()
        if isinstance(sub, nn.Sequential) and _layer_shapes(sub) == whole  # the backbone is the pipe now
    ]


def mirror_apart(mirror: str, ranks: list[int], first: int, when: str) -> str:
    """The error for a copy of the backbone outside it that the stages changed apart (``_copies_of_the_backbone``)."""
    return (
        f"{when}, `{mirror}` differed between the stages (rank(s) {ranks} from the first stage's, rank {first}). "
        f"`{mirror}` is a copy of the backbone outside it (the same layers and shapes), which every stage holds whole. "
        f"Code that updates it from `self.backbone.parameters()` during a fit, such as a momentum encoder's "
        f"`zip(self.backbone.parameters(), self.{mirror}.parameters())`, gets this rank's stage only, so each stage "
        "wrote its own layers into the copy's first ones and no stage updated the rest: the copy would be wrong on "
        "every stage. For an average of the backbone, make `torch.optim.swa_utils.AveragedModel(self.backbone)` in "
        "`__init__` (the strategy cuts it like the pipe) or use `EMAWeightAveraging`; a copy updated from the backbone "
        "and run during the fit is not supported over several stages: train it with `devices=1` or DDP."
    )


def _pair_copy(callback: str, copy: nn.Module, module: nn.Module, fresh: bool) -> None:
    """Check that a weight average's cut ``copy`` pairs with the pipelined ``module`` tensor by tensor, as the
    averaging callbacks zip them; a ``fresh`` copy (made in this ``fit``'s setup, before the layers outside the
    backbone were made equal on every stage) takes the module's values, as a copy made after that would hold."""
    copied, live = [*copy.parameters(), *copy.buffers()], [*module.parameters(), *module.buffers()]
    if len(copied) != len(live) or any(c.shape != t.shape for c, t in zip(copied, live)):
        raise RuntimeError(
            f"The model copy of {callback} does not pair with the pipelined model tensor by tensor "
            f"({len(copied)} tensors against {len(live)}), so it would average the wrong weights. Report this with "
            "your model's structure; meanwhile train with this callback on one device or with DDP."
        )
    if fresh:
        with torch.no_grad():
            for c, t in zip(copied, live):
                c.copy_(t)
