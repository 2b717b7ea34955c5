"""Collectives that never outwait a failure: each one polls a watch function until it completes.

A blocking ``torch.distributed`` collective waits for its peers for the process group's whole
timeout (30 minutes by default), even when a peer has already failed, or is waiting inside a
backbone call that this rank never made. Each collective here is started asynchronously and
polled: between polls it calls ``watch()``, which raises (a :class:`~lightning_gpipe.PipelineError`)
as soon as the failure board or the pipeline's inboxes show that the peers will never join. The
object collectives send pickled bytes as tensors, because torch's own object collectives have no
asynchronous form. (Peers of one job unpickle each other's objects, as torch's own do.)
"""

from __future__ import annotations

import pickle
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine.deadlock import blocked, collective_wait

__all__ = [
    "is_distributed",
    "default_backend",
    "backend_for",
    "wait",
    "barrier",
    "all_gather",
    "all_gather_with_gradients",
    "all_reduce",
    "broadcast_object",
    "gather_objects",
    "new_group",
    "reduce_op",
    "Watch",
    "Watching",
]

#: Called while a collective is pending; raises to abandon it.
Watch = Callable[[], None]


class Watching:
    """A :data:`Watch` that names what its collective is for, so that a deadlock's error can say it.

    ``lost(doing, error)``, where given, is the error to raise when a peer's closed connection broke the
    collective and no rank has said why (the failure board's :meth:`~lightning_gpipe.engine.failure.FailureBoard.lost`).
    """

    def __init__(
        self,
        check: Callable[[], None],
        doing: str,
        lost: Optional[Callable[[str, BaseException], BaseException]] = None,
    ) -> None:
        self.check, self.doing, self.lost = check, doing, lost

    def __call__(self) -> None:
        self.check()


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and its default group is initialized."""
    return dist.is_available() and dist.is_initialized()


def default_backend(device: torch.device) -> str:
    """The backend of the job's default process group, as Lightning's DDP picks it: NCCL on GPUs, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


def backend_for(device: torch.device) -> str:
    """The backend of this package's own groups: gloo for CPU tensors, beside NCCL for CUDA ones on GPUs.

    Gloo beside NCCL lets small CPU messages (headers, objects, counts) travel in GPU jobs too.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def new_group(ranks: list[int], backend: str, timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroup]:
    """A process group of ``ranks``; ``None`` on the ranks outside it. Collective: every rank of the job calls it,
    for every group, in the same order."""
    group = dist.new_group(ranks, timeout=timeout, backend=backend)
    return group if isinstance(group, dist.ProcessGroup) else None


def wait(
    work: Optional[dist.Work], watch: Optional[Watch], operation: str = "", group: Optional[dist.ProcessGroup] = None
) -> None:
    """Wait for ``work``, calling ``watch`` between polls (from every 0.1 ms up to every 10 ms).

    ``operation`` over ``group`` names the collective for :mod:`~lightning_gpipe.engine.deadlock`, which is told
    that this thread waits for it.
    """
    if work is None:
        return
    if watch is None:
        work.wait()
        return
    doing = getattr(watch, "doing", "a collective")
    with blocked(*collective_wait(operation, group, doing)) if operation else nullcontext():
        pause, start = 1e-4, time.monotonic()
        while not work.is_completed():
            watch()
            time.sleep(pause)
            # A rank that waits for a peer still finishing its step polls every ms, so that it does not start
            # the next step up to 10 ms late (measured: a per-step decision over the ranks cost a K=2
            # Transformer step 2-4% with 10 ms polls); a long wait polls every 10 ms.
            pause = min(2 * pause, 1e-3 if time.monotonic() - start < FINE_POLLING else 1e-2)
    try:
        work.wait()  # raises the transport's error, if any
    except RuntimeError as error:
        # A peer that failed closes its connections as it exits, which can end the collective before the
        # failure board has told this rank why: give the board a moment to, so the error names the stage
        # and its exception instead of gloo's "connection closed".
        deadline = time.monotonic() + ACCOUNT_GRACE
        while time.monotonic() < deadline:
            watch()
            time.sleep(0.05)
        lost = getattr(watch, "lost", None)
        if lost is None:
            raise
        raise lost(doing, error) from error  # no rank said why: a killed one cannot, and its heartbeat stopped


#: Seconds a collective polls every millisecond before it polls every 10 ms.
FINE_POLLING = 0.5

#: Seconds a broken collective waits for the failure board's account of the peer that broke it.
ACCOUNT_GRACE = 2.0


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def barrier(group: Optional[dist.ProcessGroup] = None, watch: Optional[Watch] = None) -> None:
    """Every rank of ``group`` reaches this point."""
    wait(dist.barrier(group=group, async_op=True), watch, "barrier", group)


def all_reduce(
    tensor: Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Optional[dist.ProcessGroup] = None,
    watch: Optional[Watch] = None,
) -> Tensor:
    """``tensor`` reduced over ``group``, in place."""
    wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), watch, "all_reduce", group)
    return tensor


def reduce_op(op: Any) -> tuple[Any, bool]:
    """torch's ``ReduceOp`` for a reduction named as Lightning names them, and whether it is a mean.

    A mean is a sum that the caller divides by the group size (gloo has no average).

    >>> reduce_op("mean")
    (<RedOpType.SUM: 0>, True)
    """
    name = op.lower() if isinstance(op, str) else op
    if name in (None, "mean", "avg"):
        return dist.ReduceOp.SUM, True
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    return ops.get(name, name), False


def all_gather(tensor: Tensor, group: Optional[dist.ProcessGroup] = None, watch: Optional[Watch] = None) -> Tensor:
    """``tensor`` from every rank of ``group``, stacked along a new first dim in group order (equal shapes).

    Without a process group (one process), ``tensor`` alone, stacked the same way.
    """
    if not is_distributed():
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(_size(group))]
    wait(dist.all_gather(parts, tensor.contiguous(), group=group, async_op=True), watch, "all_gather", group)
    return torch.stack(parts)


def all_gather_with_gradients(
    tensor: Tensor, group: Optional[dist.ProcessGroup] = None, watch: Optional[Watch] = None
) -> Tensor:
    """:func:`all_gather`, differentiable: the gradient of ``tensor`` is the sum over the ranks of the gradient of its
    row (a contrastive loss over the features of every data-parallel rank, ``all_gather(x, sync_grads=True)``).

    Written by hand because torch's ``torch.distributed.nn.functional.all_gather`` fails in its backward over a
    subgroup on gloo: its all-to-all scatters from ``src=i``, a rank of the group taken as a global rank ("Global rank
    1 is not part of group"), and a pipeline's replicas are such a subgroup. Both directions are watched collectives.
    """
    return _GatherWithGradients.apply(tensor, group, watch)


class _GatherWithGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Optional[dist.ProcessGroup], watch: Optional[Watch]) -> Tensor:
        ctx.group, ctx.watch = group, watch
        ctx.index = dist.get_rank(group) if is_distributed() else 0
        return all_gather(tensor, group, watch)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None]:
        if not is_distributed():
            return grad[0], None, None
        rows = grad.clone(memory_format=torch.contiguous_format)  # reduced in place
        total = all_reduce(rows, group=ctx.group, watch=ctx.watch)  # every rank's use of each row
        return total[ctx.index], None, None


def _as_bytes(obj: Any, device: torch.device) -> Tensor:
    data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _from_bytes(tensor: Tensor) -> Any:
    return pickle.loads(tensor.cpu().numpy().tobytes())


def broadcast_object(
    obj: Any,
    src: int,
    group: Optional[dist.ProcessGroup] = None,
    watch: Optional[Watch] = None,
    device: torch.device = torch.device("cpu"),
) -> Any:
    """``obj`` as global rank ``src`` has it, on every rank of ``group``."""
    mine = dist.get_rank() == src
    data = _as_bytes(obj, device) if mine else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=device)
    wait(dist.broadcast(size, src, group=group, async_op=True), watch, "broadcast", group)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait(dist.broadcast(data, src, group=group, async_op=True), watch, "broadcast", group)
    return obj if mine else _from_bytes(data)


def gather_objects(
    obj: Any,
    group: Optional[dist.ProcessGroup] = None,
    watch: Optional[Watch] = None,
    device: torch.device = torch.device("cpu"),
    dst: Optional[int] = None,
) -> Optional[list[Any]]:
    """``obj`` from every rank of ``group``, in group order: on every rank, or with ``dst`` on that rank only.

    The gather to one rank still all-gathers the sizes, so every rank pads to the same length.
    """
    data = _as_bytes(obj, device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(_size(group))]
    wait(
        dist.all_gather(
            sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group, async_op=True
        ),
        watch,
        "all_gather",
        group,
    )
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    if dst is None:
        parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
        wait(dist.all_gather(parts, padded, group=group, async_op=True), watch, "all_gather", group)
    else:
        mine = dist.get_rank() == dst
        parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes] if mine else []
        wait(dist.gather(padded, parts if mine else None, dst=dst, group=group, async_op=True), watch, "gather", group)
        if not mine:
            return None
    return [_from_bytes(p[: int(s.item())]) for p, s in zip(parts, sizes)]
