"""Workers for checkpointing by count: Lightning fits with ``checkpoint="keep:N"`` on K processes; the recomputes."""

from __future__ import annotations

from typing import Any

import _sweeps
import torch

#: Keep the last N micro-batches: N between 1 and M, M not dividing the batch of 8, and N at least M (never).
KEEP_CONFIGS = [
    _sweeps.Config(
        "chunks=4 keep:2 sgd", model=(("optimizer", "sgd"),), strategy=(("chunks", 4), ("checkpoint", "keep:2"))
    ),
    _sweeps.Config(
        "chunks=3 keep:2 adam", model=(("optimizer", "adam"),), strategy=(("chunks", 3), ("checkpoint", "keep:2"))
    ),
    _sweeps.Config(
        "chunks=4 keep:9 adam", model=(("optimizer", "adam"),), strategy=(("chunks", 4), ("checkpoint", "keep:9"))
    ),
]


def keep_sweep(rank: int, world_size: int) -> dict[str, Any]:
    """Every :data:`KEEP_CONFIGS` fit, and which micro-batches the engine recomputed in one step of ``keep:2``."""
    torch.set_num_threads(1)
    results: dict[str, Any] = {c.name: _sweeps.run_config(c, world_size) for c in KEEP_CONFIGS}
    results["recomputed"] = recomputed_micro_batches()
    return results


class _Recomputes:
    """A tracer (the engine's ``Tracer`` protocol) that records which micro-batches were recomputed."""

    def __init__(self) -> None:
        self.micro: list[int] = []

    def start(self, kind: str) -> None:
        return None

    def stop(self, kind: str, micro: int, token: Any) -> None:
        if kind == "recompute":
            self.micro.append(micro)


def recomputed_micro_batches() -> list[int]:
    """The micro-batches this stage recomputed in one training step of ``GPipe(chunks=4, checkpoint="keep:2")``."""
    import _models as M
    import torch.distributed as dist

    from lightning_gpipe import GPipe

    if not dist.is_initialized():  # Lightning's, when a fit ran before in this process
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    pipe = GPipe(M.mlp(), chunks=4, checkpoint="keep:2")
    tracer = _Recomputes()
    pipe.runner.tracer = tracer
    pipe(torch.randn(8, M.FEATURES)).sum().backward()
    pipe.close()
    return tracer.micro
