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
        if (isinstance(m, _BatchNorm) and m.track_running_stats and not isinstance(m, DeferredBatchNorm))
        or _scripted_batch_norm(m)
    ]


def _scripted_batch_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm that tracks running statistics, compiled by ``torch.jit.script``.

    A scripted module is a ``RecursiveScriptModule``, not a ``_BatchNorm``: ``isinstance`` misses it, and it
    cannot be replaced inside a scripted parent. Its ``original_name`` still names the class it came from.
    """
    return (
        isinstance(module, torch.jit.ScriptModule)
        and "BatchNorm" in getattr(module, "original_name", "")
        and getattr(module, "running_mean", None) is not None
    )


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
        # The mini-batch so far, per micro-batch: its number of values per channel, and its mean and unbiased
        # variance, written by BatchNorm's own kernel (see `forward`). Plain attributes, not buffers: they live for
        # one mini-batch, and each micro-batch gets new tensors, which its graph may hold.
        self._sizes: list[int] = []
        self._means: list[Tensor] = []
        self._vars: list[Tensor] = []
        self._merge_weights: dict[tuple[tuple[int, ...], torch.device], tuple[Tensor, Tensor, Tensor]] = {}

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects (N, C, ...) input, got a {input.dim()}D tensor.")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if is_recomputing():
            return nn.functional.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        # The kernel that normalizes computes the micro-batch's mean and unbiased variance anyway: with momentum 1
        # it writes them into the zeros given as its running statistics, so tracking costs no pass over the input
        # (a separate `var_mean` and merge per call cost this package's AmoebaNet about 40% of a forward).
        mean, var = torch.zeros(2, self.num_features, dtype=self.running_mean.dtype, device=input.device).unbind(0)
        output = nn.functional.batch_norm(input, mean, var, self.weight, self.bias, True, 1.0, self.eps)
        self._sizes.append(input.numel() // max(input.shape[1], 1))
        self._means.append(mean)
        self._vars.append(var)
        if len(self._sizes) >= (getattr(_call, "count", None) or self.chunks):
            self._commit()
        return output

    @torch.no_grad()
    def _commit(self) -> None:
        """Merge the micro-batches' statistics (Chan et al.'s parallel variance, in float64) and move the running
        statistics once, as BatchNorm on the whole mini-batch would.

        The merge is a few matrix-vector products with weights that depend only on the micro-batch sizes (cached:
        they repeat every step), because on the CPU each tensor operation here costs more than its arithmetic.
        """
        means = torch.stack(self._means, 1).double()  # (features, micro-batches)
        variances = torch.stack(self._vars, 1).double()
        share, within, between = self._weights(tuple(self._sizes), means.device)
        mean = torch.mv(means, share)
        deviation = (means - mean.unsqueeze(1)).square_()
        unbiased = torch.addmv(torch.mv(variances, within), deviation, between)
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        self._reset()

    def _weights(self, sizes: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Per micro-batch of ``sizes`` values: its share of the mini-batch's mean, and the weights of its unbiased
        variance and of its mean's squared deviation in the mini-batch's unbiased variance."""
        cached = self._merge_weights.get((sizes, device))
        if cached is None:
            n = torch.tensor(sizes, dtype=torch.float64)
            total = float(n.sum())
            rest = max(total - 1.0, 1.0)
            share, within, between = (w.to(device) for w in (n / total, (n - 1) / rest, n / rest))
            cached = share, within, between
            self._merge_weights = {(sizes, device): cached}  # one entry: the sizes of every full batch
        return cached

    def _reset(self) -> None:
        """Forget a partial mini-batch."""
        self._sizes, self._means, self._vars = [], [], []

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
        scripted = [name or "(the module itself)" for name, m in module.named_modules() if _scripted_batch_norm(m)]
        if scripted:
            raise ValueError(
                f"deferred_batch_norm: the BatchNorm layer {scripted[0]!r} is compiled by `torch.jit.script` (inside "
                "a ScriptModule), and a scripted module cannot be replaced by a DeferredBatchNorm, so its running "
                "statistics would move once per micro-batch (DeferredBatchNorm cannot be scripted either). Leave the "
                "BatchNorm unscripted (script the layers around it), or use chunks=1."
            )
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
