"""Data-parallel replicas of a pipeline: average each stage's gradients over its replicas, in buckets.

Every pipeline computes the gradients of its own share of the global batch; the same stage of every
pipeline then averages them, as DDP would. A stage's gradients are final only after the backward of
its last micro-batch (every micro-batch adds to every layer), so the engine arms the sync just before
that backward: from then on, each bucket goes out as an asynchronous all-reduce as soon as all its
gradients have been accumulated, and travels while the rest of the drain runs. ``finish`` sends what
is left (the layers outside the backbone, unused parameters) and waits; a parameter no replica has a
gradient for keeps ``.grad = None``, as under DDP. DDP's reducer cannot be used:
it hooks the module's forward, and a stage's forward runs once per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.engine import distributed

__all__ = [
    "GradientSync",
    "broadcast_buffers_from_first_replica",
    "broadcast_from_first_replica",
    "refuse_sparse_gradients",
    "with_presence",
]

_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def refuse_sparse_gradients(module: nn.Module, replicas: int) -> None:
    """Raise, naming the layers, where ``module`` makes sparse gradients and ``replicas`` data-parallel pipelines
    would average them.

    The replicas average each stage's gradients as flat dense buckets (see :class:`GradientSync`); a sparse
    gradient cannot join them, and DDP's own reducer, which can, does not fit a stage (module docstring). Refused
    at setup rather than with torch's "reshape is not implemented for sparse tensors" at the first step.
    """
    if replicas < 2:
        return
    found = [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    if found:
        raise ValueError(
            f"{', '.join(f'`{n}`' for n in found[:4])} make{'s' * (len(found) == 1)} sparse gradients "
            f"(`sparse=True`), which the gradient average over the {replicas} data-parallel replicas of the pipeline "
            "does not support. Make them dense (`sparse=False`), or train one pipeline (devices equal to the stages "
            "per pipeline), which keeps sparse gradients."
        )


def with_presence(grads: list[Optional[Tensor]], params: list[nn.Parameter]) -> Tensor:
    """``params``' gradients flat for a sum over ranks (zeros for ``None``), then one flag each: 1 where a gradient is.

    After the sum, a parameter whose flag is 0 had no gradient on any rank: it keeps ``.grad = None``, as under
    DDP and on one device. An optimizer skips a ``None`` gradient but steps a zero one (momentum, weight decay,
    Adam's moments). Read the flags as ``flat[-len(params):]``.
    """
    sparse = next((g for g in grads if g is not None and g.layout != torch.strided), None)
    if sparse is not None:  # a layer the setup check does not know, or a tie (its copies' gradients are summed here)
        raise RuntimeError(
            f"A parameter of shape {tuple(sparse.shape)} has a gradient of layout {sparse.layout}, which neither the "
            "gradient average over data-parallel replicas nor the sum of a tied parameter's copies over the stages "
            "supports (both add dense buffers). Make it dense (`sparse=False`); a sparse embedding that is not tied "
            "across stages trains in one pipeline of any K."
        )
    flags = torch.tensor([g is not None for g in grads], dtype=params[0].dtype, device=params[0].device)
    return torch.cat(
        [*((g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)), flags]
    )


def _buckets(params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one dtype and device, up to ``limit`` bytes a bucket."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if (
            buckets
            and (p.dtype, p.device) == (buckets[-1][0].dtype, buckets[-1][0].device)
            and size + p.numel() * p.element_size() <= limit
        ):
            buckets[-1].append(p)
            size += p.numel() * p.element_size()
        else:
            buckets.append([p])
            size = p.numel() * p.element_size()
    return buckets


class GradientSync:
    """Averages the gradients of a stage (and of the replicated layers outside it) over ``group``.

    Example (the engine arms it; a training loop calls ``finish`` after ``backward``)::

        sync = GradientSync(stage.parameters(), group=replica_group)
        sync.add_replicated(head.parameters())
        loss.backward()          # the engine calls sync.arm() before the last micro-batch's backward
        sync.finish()            # every rank now holds the replicas' average gradient
    """

    def __init__(
        self, params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup], bucket_bytes: int = _BUCKET_BYTES
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.enabled = True  # off while gradients accumulate over several batches
        self._bucket_bytes = bucket_bytes
        # backward meets the layers in reverse, so buckets fill in reverse order of registration
        stage = [p for p in params if p.requires_grad][::-1]
        self._stage = _buckets(stage, bucket_bytes)
        self._replicated: list[list[nn.Parameter]] = []
        self._bucket_of = {id(p): i for i, bucket in enumerate(self._stage) for p in bucket}
        self._remaining: Optional[list[int]] = None
        self._launched: set[int] = set()
        self._seen: set[int] = set()
        self._stale: set[int] = set()
        self._works: list[tuple[dist.Work, Tensor, list[nn.Parameter]]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in stage]

    def add_replicated(self, params: Iterable[nn.Parameter]) -> None:
        """Also average these (layers outside the backbone, the same on every stage of a pipeline)."""
        self._replicated = _buckets([p for p in params if p.requires_grad], self._bucket_bytes)

    def arm(self) -> None:
        """The next backward makes the stage's gradients final: send each bucket as soon as it is complete."""
        if self.enabled and self.group is not None:
            self._remaining = [len(bucket) for bucket in self._stage]
            self._seen.clear()

    def _accumulated(self, param: nn.Parameter) -> None:
        if self._remaining is None:
            return
        index = self._bucket_of[id(param)]
        if id(param) in self._seen:  # used twice in the stage: its bucket goes again, complete, at finish
            self._stale.add(index)
            return
        self._seen.add(id(param))
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            self._launch(index, self._stage[index])

    def _launch(self, index: int, bucket: list[nn.Parameter]) -> None:
        self._launched.add(index)
        flat = with_presence([p.grad for p in bucket], bucket)
        flat.div_(self.size)
        self._works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))

    def finish(self, watch: Optional[distributed.Watch] = None) -> None:
        """Send the buckets still waiting, wait for all, and put the averages into ``.grad``.

        ``watch``: what the waits poll (:func:`~lightning_gpipe.engine.distributed.wait`), so that a replica that
        failed or was killed is named, not only gloo's "Connection reset by peer".
        """
        if not self.enabled or self.group is None:
            return
        for index, bucket in enumerate(self._stage):
            if index not in self._launched or index in self._stale:  # not complete yet, or grown since it went
                self._launch(index, bucket)  # results are written back in launch order: the later one wins
        for bucket in self._replicated:
            self._launch(-1, bucket)
        for work, flat, bucket in self._works:
            distributed.wait(work, watch, "all_reduce", self.group)
            offset = 0
            used = flat[-len(bucket) :].tolist()
            for p, anywhere in zip(bucket, used):
                value = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if not anywhere:
                    continue  # no replica had a gradient for it
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
        self._works.clear()
        self._launched.clear()
        self._stale.clear()
        self._remaining = None

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def broadcast_buffers_from_first_replica(buffers: Iterable[Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Every replica takes the first replica's buffers, as DDP's ``broadcast_buffers`` gives every rank rank 0's
    before a forward: BatchNorm's running statistics, which each replica's own data would move apart. One
    broadcast per dtype and device (DDP coalesces too): a model has many small buffers."""
    if group is None:
        return
    source = dist.get_process_group_ranks(group)[0]
    kinds: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for buffer in buffers:
        kinds.setdefault((buffer.dtype, buffer.device), []).append(buffer)
    with torch.no_grad():
        for same in kinds.values():
            flat = torch.cat([b.reshape(-1) for b in same])
            dist.broadcast(flat, src=source, group=group)
            for buffer, value in zip(same, flat.split([b.numel() for b in same])):
                buffer.copy_(value.view_as(buffer))


def broadcast_from_first_replica(tensors: Iterable[Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Give every replica the first replica's values (a start from equal weights, as DDP makes it)."""
    if group is None:
        return
    source = dist.get_process_group_ranks(group)[0]
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=source, group=group)
