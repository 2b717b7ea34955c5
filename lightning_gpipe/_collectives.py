"""The strategy's collectives: over a stage's data-parallel replicas by default, decisions over every rank.

The stages of one pipeline hold the same logged values (every rank computes the loss on the real
output), so reductions and gathers that stand for "over the data" run over the replicas of a stage
(DeviceMesh dim ``dp``); counting them once per stage would be wrong for a sum.

Every collective polls for failures while it waits (:mod:`lightning_gpipe.distributed`), and after
this rank failed they are skipped: Lightning still runs callbacks (``OnExceptionCheckpoint``) and
its teardown then, and the other ranks will not join.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_gpipe import distributed

__all__ = ["ReplicaCollectives"]


class ReplicaCollectives:
    """Mixed into :class:`~lightning_gpipe.GPipeStrategy` (it provides ``layout``, ``root_device``, ``_mesh``)."""

    layout: Any
    root_device: torch.device
    world_size: int
    pipe: Any
    failed: bool
    _board: Any
    _mesh: Optional[Any]

    def _active(self) -> bool:
        """Whether collectives run: distributed, and this rank has not failed."""
        return distributed.is_distributed() and not self.failed

    def _watch(self, doing: str, whole_pipeline: bool = True) -> distributed.Watch:
        """What a collective polls: the pipeline's watch for collectives that every stage joins, else the board."""
        if whole_pipeline and self.pipe is not None:
            return self.pipe.watch(doing)  # type: ignore[no-any-return]
        board = self._board
        return board.raise_if_failed if board is not None else (lambda: None)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if self._active():
            distributed.barrier(watch=self._watch(f"Lightning's barrier {name!r}" if name else "a barrier"))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._active():
            return obj
        return distributed.broadcast_object(obj, src, watch=self._watch("a broadcast"), device=self.root_device)

    @property
    def replica_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's stage in every pipeline (DeviceMesh dim ``dp``): the group to reduce metrics over.

        ``None`` with one pipeline. Pass it to torchmetrics as ``process_group`` so that metric states
        are not counted once per stage.
        """
        if self._mesh is None or self.layout.num_replicas == 1:
            return None
        return self._mesh.get_group("dp")

    def _replicas_only(self, group: Optional[Any]) -> bool:
        # the default group of reduce and all_gather is the replicas of this stage: the stages of one
        # pipeline hold the same values, and counting them once per stage would be wrong for a sum
        return group is None and self.replica_group is None

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        """Reduce over the data-parallel replicas (by default): every stage gets the same result."""
        if not isinstance(tensor, Tensor) or not self._active():
            return tensor
        if self._replicas_only(group):
            return tensor.clone()
        group = group if group is not None else self.replica_group
        op = reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
        mean = op in (None, "mean", "avg")
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        torch_op = dist.ReduceOp.SUM if mean else ops.get(op, op)  # type: ignore[arg-type]
        tensor = tensor.float() if mean and not tensor.is_floating_point() else tensor.clone()
        distributed.all_reduce(tensor, torch_op, group, self._watch("a reduce", whole_pipeline=False))
        if mean:
            tensor = tensor / dist.get_world_size(group)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather from the data-parallel replicas (by default), stacked in replica order."""
        if self._replicas_only(group) or not self._active():
            return tensor.unsqueeze(0)
        return super().all_gather(tensor, group=group if group is not None else self.replica_group,
                                  sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Decided over every rank (stopping, say): the stages of a pipeline must go on or stop together."""
        if not self._active():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        distributed.all_reduce(votes, watch=self._watch("a decision of every rank (stop or go on)"))
        return bool(votes == self.world_size) if all else bool(votes)
