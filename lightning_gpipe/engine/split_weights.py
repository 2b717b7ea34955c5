"""Backbone weights changed between the split and the first training step: loaded (fine) or drawn (refused).

Hooks that run after the backbone was split and before the first training step (``on_fit_start``,
``on_train_start``, a callback's) reach this process's stage only: ``self.backbone.modules()``, ``self.apply`` and
``self.parameters()`` hold its layers alone. Fixed weights loaded there equal one device's. Weights drawn at random
there do not: one device draws every layer in turn from one random stream, while each stage draws its own layers
from the stream's start (1.05 off one device in a probe, ``xavier_uniform_`` in ``on_fit_start``, without a word).

:class:`SplitWeights` fingerprints a stage's parameters at the split and after a restore, and tells at the first
step what changed. The stages' answers, gathered, go to :func:`judge`: a change is random where the stages' random
states parted meanwhile (stages of unequal sizes drew unequal amounts) or where every stage's changed weights hold
the very same values (stages of equal shapes drew from the same point of the stream); otherwise it may be a load.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

from torch import nn

from lightning_gpipe.engine.agreement import digest
from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.microbatch import fingerprints

__all__ = ["WEIGHTS_CHANGED_AFTER_THE_SPLIT", "SplitWeights", "judge"]

#: Why backbone weights changed between the split and the first step can differ from one device's, and what to do.
WEIGHTS_CHANGED_AFTER_THE_SPLIT = (
    "These hooks (`on_fit_start`, `on_train_start`, `on_train_epoch_start`, `on_train_batch_start`, a callback's) run "
    "after the backbone was split, when each process holds only its own stage's layers: `self.backbone.modules()`, "
    "`self.apply(...)` and `self.parameters()` reach this stage's layers alone. Fixed values loaded there "
    "(`self.backbone.load_state_dict(...)`) train as on one device. Values drawn at random do not: one device draws "
    "every layer in turn from one random stream, while here each stage draws its own layers from the stream's start, "
    "so the stages' layers take other values than one device's. Initialize or perturb the weights at random in "
    "`__init__`, `setup()` or `configure_model()`, where every rank still holds the whole backbone (every stage then "
    "starts from the first rank's weights)."
)

#: :meth:`SplitWeights.changed` where every changed parameter holds a single value (a constant: no random draw)
CONSTANT = 1


class SplitWeights:
    """One stage's backbone weights as at the split (a fingerprint each), until the first training step.

    >>> stage = nn.Linear(2, 2)
    >>> weights = SplitWeights()
    >>> weights.note(stage.parameters())
    >>> weights.changed(stage.parameters())
    0
    >>> _ = nn.init.zeros_(stage.bias)
    >>> weights.changed(stage.parameters())
    1
    """

    def __init__(self) -> None:
        self.at_split: Optional[list[int]] = None  # None: nothing watched (no fit over stages, or already compared)
        self.rng_apart = False  # whether the stages' random states were found apart since the note

    @property
    def watching(self) -> bool:
        return self.at_split is not None

    def note(self, parameters: Optional[Iterable[nn.Parameter]]) -> None:
        """Keep the fingerprints of ``parameters`` (None: stop watching); forget random states found apart."""
        self.rng_apart = False
        self.at_split = fingerprints([p.detach() for p in parameters]) if parameters is not None else None

    def changed(self, parameters: Iterable[nn.Parameter]) -> int:
        """0 where the weights are as noted (or nothing is watched); else a digest of the changed parameters that
        hold more than one value (equal on stages that changed alike), or :data:`CONSTANT`."""
        if self.at_split is None:
            return 0
        params = list(parameters)
        now = fingerprints([p.detach() for p in params])
        if now == self.at_split:
            return 0
        drawn = [
            value
            for p, value, then in zip(params, now, self.at_split)
            if value != then and p.numel() > 1 and bool((p.detach() != p.detach().flatten()[0]).any())
        ]
        return max(digest(drawn), CONSTANT + 1) if drawn else CONSTANT


def judge(changed: Sequence[int], rng_apart: bool, ranks: Sequence[int], batch: int) -> Optional[str]:
    """Every stage's :meth:`SplitWeights.changed` (in stage order) at training batch ``batch``: raises
    :class:`PipelineError` where the change was random; the warning to give where it may be a load; else None."""
    stages = [stage for stage, value in enumerate(changed) if value]
    if not stages:
        return None
    where = " and ".join(f"stage {stage} (rank {ranks[stage]})" for stage in stages)
    when = f"Between the backbone's split (the strategy's setup) and training batch {batch}, code changed the"
    alike = len(stages) == len(changed) and changed[0] != CONSTANT and len(set(changed)) == 1
    if rng_apart or alike:
        evidence = (
            "the stages drew different amounts of random numbers"
            if rng_apart
            else "every stage's changed weights now hold the very same values, as stages of equal shapes that "
            "drew from the same point of the random stream do"
        )
        raise PipelineError(
            f"{when} backbone's weights on {where}, and {evidence}: a random (re-)initialization or perturbation of "
            "the backbone after the split, which would train other weights than one device's. "
            f"{WEIGHTS_CHANGED_AFTER_THE_SPLIT}"
        )
    return f"{when} backbone's weights on {where}. {WEIGHTS_CHANGED_AFTER_THE_SPLIT}"
