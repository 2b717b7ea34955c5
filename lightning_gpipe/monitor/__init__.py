"""Seeing what each stage did: ``PipelineMonitor`` (a Lightning callback), ``StageTimer`` and the timeline.

:class:`~lightning_gpipe.monitor.timer.StageTimer` implements the engine's tracing hook
(:class:`lightning_gpipe.engine.tracer.Tracer`) and works without Lightning, as does ``timeline``
(Chrome trace and PNG); :class:`~lightning_gpipe.monitor.callback.PipelineMonitor` logs and prints
per-stage times, utilization and the bubble from a Lightning run.
"""

from lightning_gpipe.monitor.timer import StageTimer

__all__ = ["StageTimer"]

try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # plain PyTorch use of the timer
    pass
else:
    from lightning_gpipe.monitor.callback import PipelineMonitor  # noqa: F401

    __all__ += ["PipelineMonitor"]
