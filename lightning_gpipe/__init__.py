"""GPipe pipeline parallelism for PyTorch Lightning: ``Trainer(strategy="gpipe", devices=K)``.

The engine (``GPipe`` and everything under it) is plain PyTorch and works without Lightning; the
strategy is the Lightning glue, and importing this package registers it as ``"gpipe"``.
"""

from lightning_gpipe.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine import is_recomputing
from lightning_gpipe.failure import PipelineError
from lightning_gpipe.partition import balance
from lightning_gpipe.pipe import GPipe
from lightning_gpipe.profiling import LayerCosts, profile_layers
from lightning_gpipe.timer import StageTimer
from lightning_gpipe.topology import PipeLayout

__all__ = [
    "DeferredBatchNorm", "GPipe", "GPipeStrategy", "LayerCosts", "PipeLayout", "PipelineError", "PipelineMonitor",
    "StageTimer", "balance", "is_recomputing", "profile_layers", "__version__",
]

__version__ = "0.1.0"

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError:  # plain PyTorch use of the engine
    pass
else:
    from lightning_gpipe.callbacks import PipelineMonitor
    from lightning_gpipe.strategy import GPipeStrategy

    # Lightning has no entry point for strategies: importing this package is what makes "gpipe" known.
    GPipeStrategy.register_strategies(StrategyRegistry)
