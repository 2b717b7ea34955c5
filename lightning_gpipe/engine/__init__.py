"""The pipeline engine: plain PyTorch, no Lightning.

:class:`GPipe` runs an ``nn.Sequential`` as a fill-drain pipeline, one stage per process. Under it:
the stage runner and its autograd bridge (``stage``), re-materialization (``checkpoint``), the
schedule, micro-batches, random streams, the split (``partition``) and the process layout
(``topology``), messages and channels between stages, the lock-step checks, the failure board, the
polled collectives (``distributed``), gradient sync across replicas, tied weights, global-norm
clipping, ``DeferredBatchNorm`` and the tracing hook. ``grad_norm`` and ``clip_grad_norm_`` (``gradients``)
are torch's and Lightning's functions for the whole model, for code that runs on every stage. See
``docs/architecture.md``.
"""

from lightning_gpipe.engine import (
    grad_scaler,  # noqa: F401  (routes torch's GradScaler once a pipeline is built)
    torch_clipping,  # noqa: F401  (routes torch's clip_grad_norm_ once a pipeline is built)
)
from lightning_gpipe.engine.batchnorm import DeferredBatchNorm
from lightning_gpipe.engine.checkpoint import is_recomputing
from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.gradients import clip_grad_norm_, grad_norm
from lightning_gpipe.engine.partition import balance
from lightning_gpipe.engine.pipe import GPipe
from lightning_gpipe.engine.topology import PipeLayout
from lightning_gpipe.engine.tracer import Tracer

__all__ = [
    "DeferredBatchNorm",
    "GPipe",
    "PipeLayout",
    "PipelineError",
    "Tracer",
    "balance",
    "clip_grad_norm_",
    "grad_norm",
    "is_recomputing",
]
