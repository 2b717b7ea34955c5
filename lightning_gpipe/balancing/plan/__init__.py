"""The planner: one training step replayed on measured layer costs, for any K, M, split and checkpoint mode.

``measure.py`` profiles the layers at the micro-batch sizes a plan weighs, ``costs.py`` reads their costs
at any size, ``link.py`` models (and measures) the link between stages, ``replay.py`` replays a step of the
engine's schedule, ``search.py`` tries a grid of candidates and keeps the fastest that fits in memory.
:class:`LiveBytes` (from :mod:`lightning_gpipe.balancing.live_bytes`, which the profile uses too) measures
the tensor bytes a real step holds, to check a prediction on any device. Plain PyTorch, so a plan can be
made for 8 GPUs on a machine with one, from a profile taken there.
"""

from lightning_gpipe.balancing.live_bytes import LiveBytes
from lightning_gpipe.balancing.plan.costs import CostModel, UpdateCosts
from lightning_gpipe.balancing.plan.link import LinkModel, measure_link
from lightning_gpipe.balancing.plan.measure import measure_updates, micro_batch_sizes, profile_for_plan
from lightning_gpipe.balancing.plan.replay import Prediction, StageCost, StagePrediction, StepCosts, simulate
from lightning_gpipe.balancing.plan.search import (
    Candidate,
    Plan,
    checkpoint_modes,
    chunk_grid,
    faster_split,
    plan,
    plan_table,
)

__all__ = [
    "Candidate",
    "CostModel",
    "LinkModel",
    "LiveBytes",
    "Plan",
    "Prediction",
    "StageCost",
    "StagePrediction",
    "StepCosts",
    "UpdateCosts",
    "checkpoint_modes",
    "chunk_grid",
    "faster_split",
    "measure_link",
    "measure_updates",
    "micro_batch_sizes",
    "plan",
    "plan_table",
    "profile_for_plan",
    "simulate",
]
