"""GPipe pipeline parallelism for PyTorch Lightning: ``Trainer(strategy="gpipe", devices=K)``.

The engine (``GPipe`` and everything under :mod:`lightning_gpipe.engine`) is plain PyTorch and works
without Lightning; the strategy is the Lightning glue, and importing this package registers it as
``"gpipe"``. ``grad_norm`` and ``clip_grad_norm_`` replace Lightning's and torch's, which would see
one stage, in code that runs on every rank. The layers: ``docs/architecture.md``.
"""

from lightning_gpipe.balancing.profiling import LayerCosts, profile_layers
from lightning_gpipe.engine import (
    DeferredBatchNorm,
    GPipe,
    PipeLayout,
    PipelineError,
    balance,
    clip_grad_norm_,
    grad_norm,
    is_recomputing,
)
from lightning_gpipe.engine.skip import Namespace, PopAdd, PopCat, Stash, isolate, pop, skippable, stash
from lightning_gpipe.monitor.timer import StageTimer

__all__ = [
    "DeferredBatchNorm",
    "GPipe",
    "GPipeStrategy",
    "LayerCosts",
    "Namespace",
    "PipeLayout",
    "PipelineError",
    "PipelineMonitor",
    "PopAdd",
    "PopCat",
    "Stash",
    "StageTimer",
    "balance",
    "clip_grad_norm_",
    "grad_norm",
    "is_recomputing",
    "isolate",
    "pop",
    "profile_layers",
    "skippable",
    "stash",
    "__version__",
]

__version__ = "0.1.0"

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError:  # plain PyTorch use of the engine
    pass
else:
    from lightning_gpipe.monitor.callback import PipelineMonitor
    from lightning_gpipe.strategy import GPipeStrategy

    # Lightning has no entry point for strategies: importing this package is what makes "gpipe" known.
    GPipeStrategy.register_strategies(StrategyRegistry)
