"""Choosing the split from measured costs: per-layer profiling and the sample micro-batch it runs on.

The split itself (costs in, layers per stage out) is :mod:`lightning_gpipe.engine.partition`, because
the engine needs it to build a pipeline; this package measures the costs it balances (``"time"``,
``"memory"``), which needs the engine's micro-batching, so the dependency runs one way only.
"""

from lightning_gpipe.balancing.profiling import COST_KINDS, LayerCosts, profile_layers
from lightning_gpipe.balancing.sample import backbone_sample, capture_input, sample_micro_batch

__all__ = ["COST_KINDS", "LayerCosts", "backbone_sample", "capture_input", "profile_layers", "sample_micro_batch"]
