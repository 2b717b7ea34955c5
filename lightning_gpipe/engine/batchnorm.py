"""``DeferredBatchNorm``: BatchNorm whose running statistics cover the mini-batch, not each micro-batch.

A pipeline runs a layer once per micro-batch. Plain BatchNorm would then move its running statistics
``chunks`` times per step, each time with a micro-batch's statistics, and its ``running_var`` would
carry each micro-batch's ``n/(n-1)`` correction: after training they differ from a one-device run's.
DeferredBatchNorm keeps the per-micro-batch statistics aside, merges them, and updates the running
statistics once per mini-batch, exactly as BatchNorm on the whole mini-batch would. Plain PyTorch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "micro_batches", "per_micro_batch_norms"]

M = TypeVar("M", bound=nn.Module)

_call = threading.local()


@contextmanager
def micro_batches(count: int) -> Iterator[None]:
    """Inside: the pipeline's current call has ``count`` micro-batches; a DeferredBatchNorm commits after that many.

    The engine wraps every call of a stage in it. A batch with fewer samples than ``chunks`` (a short last
    batch) has fewer micro-batches, one per sample, and its running statistics must still move once.
    """
    outer = getattr(_call, "count", None)
    _call.count = count
    try:
        yield
    finally:
        _call.count = outer


def per_micro_batch_norms(module: nn.Module) -> list[str]:
    """The names of ``module``'s BatchNorm layers whose running statistics would move once per micro-batch.

    Those are the ones that track running statistics and are not DeferredBatchNorm: in a pipeline of
    ``chunks > 1`` they see micro-batches, so their running statistics (and their normalization, as
    in GPipe) differ from a one-device run's on the whole batch.
    """
    return [
        name
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and not isinstance(m, DeferredBatchNorm)
    ]


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm for pipelines: running statistics over the ``chunks`` micro-batches of each mini-batch.

    - Training: each micro-batch is normalized with its own statistics, as BatchNorm does with the
      batch it is given (so the forward equals a one-device run only when ``chunks == 1``, as in
      GPipe and torchgpipe). Its mean and variance are merged into the mini-batch's; after the last
      micro-batch of the mini-batch, ``running_mean`` and ``running_var`` (unbiased, over the whole
      mini-batch) move once, with BatchNorm's ``momentum`` rule, and ``num_batches_tracked`` counts 1.
      In a pipeline the last micro-batch is the last of the engine's call (:func:`micro_batches`:
      fewer than ``chunks`` for a batch of fewer samples); outside one, the ``chunks``-th.
      Given the same inputs, the running statistics equal those of BatchNorm on the whole mini-batch.
    - The recompute of a checkpointed micro-batch (``lightning_gpipe.is_recomputing()``) is not counted.
    - Evaluation: identical to BatchNorm, with the running statistics.

    Every training forward counts as one micro-batch, so use it in a pipeline's layers (the engine
    says how many micro-batches each call has) or where it is called ``chunks`` times per mini-batch:
    ``GPipeStrategy(deferred_batch_norm=True)`` converts the backbone.
    Its ``state_dict`` has BatchNorm's keys, so checkpoints load into the unconverted model.

    Example::

        model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)
    """

    # Buffers, always present here (track_running_stats=True); declared for the type checker.
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor
    _count: Tensor
    _mean: Tensor
    _m2: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        chunks: int = 1,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True, device=device, dtype=dtype)
        microbatch.check_chunks(chunks)
        self.chunks = chunks
        # The mini-batch so far: micro-batches and values seen, their mean and sum of squared deviations,
        # in float64 so that merging many micro-batches loses nothing. Buffers, so they follow the
        # module's device; non-persistent, so the state_dict stays BatchNorm's.
        self._micro = 0
        self.register_buffer("_count", torch.zeros((), dtype=torch.float64, device=device), persistent=False)
        self.register_buffer("_mean", torch.zeros(num_features, dtype=torch.float64, device=device), persistent=False)
        self.register_buffer("_m2", torch.zeros(num_features, dtype=torch.float64, device=device), persistent=False)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects (N, C, ...) input, got a {input.dim()}D tensor.")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if not is_recomputing():
            self._track(input)
        return nn.functional.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _track(self, input: Tensor) -> None:
        """Merge this micro-batch's statistics into the mini-batch's (Chan et al.'s parallel variance)."""
        dims = [0, *range(2, input.dim())]
        n = input.numel() // max(input.shape[1], 1)
        x = input.detach()
        var, mean = torch.var_mean(
            x if x.dtype in (torch.float32, torch.float64) else x.float(), dim=dims, correction=0
        )
        var, mean = var.double(), mean.double()
        total = self._count + n
        delta = mean - self._mean
        self._m2.add_(var * n + delta.square() * (self._count * n / total))
        self._mean.add_(delta * (n / total))
        self._count.copy_(total)
        self._micro += 1
        if self._micro >= (getattr(_call, "count", None) or self.chunks):
            self._commit()

    def _commit(self) -> None:
        """Move the running statistics once, as BatchNorm on the whole mini-batch would."""
        count = float(self._count)
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = self._m2 / max(count - 1.0, 1.0)
        self.running_mean.lerp_(self._mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        self._reset()

    def _reset(self) -> None:
        """Forget a partial mini-batch."""
        self._micro = 0
        for buffer in (self._count, self._mean, self._m2):
            buffer.zero_()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunks={self.chunks}"

    @classmethod
    def convert_deferred_batch_norm(cls, module: M, chunks: int = 1) -> M:
        """``module`` with every BatchNorm that tracks running statistics replaced by a DeferredBatchNorm.

        The replacements share the originals' parameters and copy their buffers and training mode.
        BatchNorms without running statistics are left alone: they always normalize by the batch
        they are given and have nothing to defer. Modules are replaced in place; the return value is
        ``module`` itself unless ``module`` is a BatchNorm. A DeferredBatchNorm already there gets the new
        ``chunks`` and forgets any partial mini-batch (from a forward outside the pipeline, say).
        """
        if isinstance(module, cls):
            module.chunks = chunks
            module._reset()
            return module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            return cls._from_batch_norm(module, chunks)  # type: ignore[return-value]
        for name, child in module.named_children():
            converted = cls.convert_deferred_batch_norm(child, chunks)
            if converted is not child:
                setattr(module, name, converted)
        return module

    @classmethod
    def _from_batch_norm(cls, norm: _BatchNorm, chunks: int) -> "DeferredBatchNorm":
        device = norm.running_mean.device  # type: ignore[union-attr]
        if device.type == "meta":
            device = torch.device("meta")
        deferred = cls(norm.num_features, norm.eps, norm.momentum, norm.affine, chunks, device=device)
        if norm.affine:
            deferred.weight, deferred.bias = norm.weight, norm.bias
        assert norm.running_mean is not None and norm.running_var is not None  # tracked: checked above
        assert norm.num_batches_tracked is not None
        with torch.no_grad():
            deferred.running_mean = norm.running_mean
            deferred.running_var = norm.running_var
            deferred.num_batches_tracked = norm.num_batches_tracked
        deferred.train(norm.training)
        return deferred
