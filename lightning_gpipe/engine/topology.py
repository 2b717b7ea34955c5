"""Which global ranks form a pipeline and which hold replicas of the same stage, and the mesh of their groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_gpipe.engine.distributed import backend_for

__all__ = ["PipeLayout", "make_mesh"]


@dataclass(frozen=True)
class PipeLayout:
    """``world_size`` processes as ``world_size // pipe_size`` data-parallel replicas of a ``pipe_size``-stage pipeline.

    Consecutive ranks form a pipeline, so with one pipeline per node (the default ``pipe_size``) the
    stages talk over the node's fast links and only the gradient all-reduce crosses nodes. It is the
    2-D mesh ``(dp, pp)`` in row-major order.

    >>> layout = PipeLayout(world_size=4, pipe_size=2)
    >>> layout.pipelines, layout.replicas(stage=1)
    ([[0, 1], [2, 3]], [1, 3])
    """

    world_size: int
    pipe_size: int

    def __post_init__(self) -> None:
        if self.pipe_size < 1 or self.world_size < 1:
            raise ValueError(
                f"`pipe_size` and the world size must be positive, got {self.pipe_size} and {self.world_size}."
            )
        if self.world_size % self.pipe_size:
            raise ValueError(
                f"`pipe_size={self.pipe_size}` does not divide the {self.world_size} processes (devices x num_nodes); "
                "choose a pipe_size that divides it, so that every replica of the pipeline is complete."
            )

    @property
    def num_replicas(self) -> int:
        """How many copies of the pipeline train on different data (the size of the ``dp`` dimension)."""
        return self.world_size // self.pipe_size

    @property
    def pipelines(self) -> list[list[int]]:
        """The ranks of every pipeline, stage 0 first."""
        p = self.pipe_size
        return [list(range(r * p, (r + 1) * p)) for r in range(self.num_replicas)]

    def stage_of(self, rank: int) -> int:
        """The stage that ``rank`` runs."""
        return rank % self.pipe_size

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica (pipeline index) that ``rank`` belongs to."""
        return rank // self.pipe_size

    def pipeline_of(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s pipeline."""
        return self.pipelines[self.replica_of(rank)]

    def replicas(self, stage: int) -> list[int]:
        """The ranks that hold ``stage``, one per pipeline: the group its gradients are averaged over."""
        return [r * self.pipe_size + stage for r in range(self.num_replicas)]


def make_mesh(layout: PipeLayout, device: torch.device) -> DeviceMesh:
    """The 2-D mesh ``(dp, pp)``: row ``r`` is pipeline ``r``, column ``k`` is stage ``k`` of every replica.

    Collective over all processes. Its groups use gloo for CPU tensors beside NCCL for CUDA ones, so
    that small CPU collectives (object broadcasts, counts) work in GPU jobs too.
    """
    backend = backend_for(device)
    return init_device_mesh(
        device.type,
        (layout.num_replicas, layout.pipe_size),
        mesh_dim_names=("dp", "pp"),
        backend_override={"dp": backend, "pp": backend},
    )
