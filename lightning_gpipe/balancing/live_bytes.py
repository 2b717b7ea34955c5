"""Bytes of the tensors a block of code holds, followed as they are made and freed, on any device.

The planner predicts a stage's peak in tensor bytes: what CUDA's ``max_memory_allocated`` reports on a
GPU. The CPU has no such counter (its resident set also holds the allocator's slack and the kernels' own
scratch memory), so measuring a prediction there needs this: a dispatch mode sees every operator in its
thread, the backward's included, counts each storage an operator creates (an output that shares no
input's storage) and follows it to its release with a finalizer on the storage. Storages that exist
before are counted only if named (``existing``); a storage first met as an operator's input (made in
another thread: a pipeline's received message) is counted from then. Plain PyTorch, no Lightning.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Inside ``with LiveBytes(existing) as live:`` the storages of ``existing`` and every storage an operator
    creates or first reads are counted while they live.

    It keeps no reference to ``existing`` (a caller that does keeps those tensors alive, so their release is
    not seen). :meth:`mark` notes a moment; :meth:`held` is the count at a mark and :meth:`peak` the most between
    marks, either leaving out given tensors' storages (say parameter gradients, which a training step keeps
    in ``.grad`` anyway).

    >>> import torch
    >>> x = torch.ones(256, requires_grad=True)  # 1 KiB
    >>> with LiveBytes([x]) as live:
    ...     live.mark("start")
    ...     y = (x * 2).exp()  # two new 1 KiB tensors; the first is freed once `exp` has run, `exp` saves its output
    ...     live.mark("forward")
    >>> live.held("start"), live.held("forward"), live.peak("start")
    (1024, 2048, 3072)
    """

    def __init__(self, existing: Iterable[Tensor] = ()) -> None:
        super().__init__()
        # Every counting and release in order, as (storage key, signed bytes); a key is a storage's
        # position in `events` at its counting, which never repeats (addresses do, once freed).
        self.events: list[tuple[int, int]] = []
        self._keys: dict[int, int] = {}  # data pointer of a live counted storage -> its key
        self._marks: dict[str, int] = {}
        for t in existing:
            self._count(t)

    @classmethod
    def training(
        cls,
        parameters: Iterable[Tensor],
        optimizer: Optional[torch.optim.Optimizer] = None,
        buffers: Iterable[Tensor] = (),
    ) -> LiveBytes:
        """Counting what a training step holds from before it starts: ``parameters``, their gradients (freed by a
        ``zero_grad`` inside, and seen to be), ``buffers`` and ``optimizer``'s state."""
        parameters = list(parameters)
        state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()]
        # The gradients only in this argument, which no name outlives: a reference would hide their release.
        grads = (p.grad for p in parameters if p.grad is not None)
        return cls([*parameters, *buffers, *grads, *(v for v in state if isinstance(v, Tensor))])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        for t in inputs:
            self._count(t)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._count(t)
        return out

    def _count(self, t: Tensor) -> None:
        """Count ``t``'s storages from now until they are freed, unless they are counted already."""
        for storage in _storages(t):
            pointer, size = storage.data_ptr(), storage.nbytes()
            if not pointer or pointer in self._keys:
                continue
            key = len(self.events)
            self._keys[pointer] = key
            self.events.append((key, size))
            weakref.finalize(storage, self._release, pointer, key, size)

    def _release(self, pointer: int, key: int, size: int) -> None:
        if self._keys.get(pointer) == key:
            del self._keys[pointer]
        self.events.append((key, -size))

    def mark(self, name: str) -> None:
        """Note this moment as ``name``, for :meth:`held` and :meth:`peak`."""
        self._marks[name] = len(self.events)

    def held(self, at: str, leave_out: Iterable[Tensor] = ()) -> int:
        """Bytes held at the mark ``at``."""
        return self._replay(0, self._marks[at], self._keys_of(leave_out))[0]

    def peak(self, since: str, until: Optional[str] = None, leave_out: Iterable[Tensor] = ()) -> int:
        """The most bytes held at any moment from the mark ``since`` to the mark ``until`` (default: now)."""
        stop = self._marks[until] if until is not None else len(self.events)
        return self._replay(self._marks[since], stop, self._keys_of(leave_out))[1]

    def _replay(self, start: int, stop: int, excluded: set[int]) -> tuple[int, int]:
        held = sum(size for key, size in self.events[:start] if key not in excluded)
        top = held
        for key, size in self.events[start:stop]:
            if key not in excluded:
                held += size
                top = max(top, held)
        return held, top

    def _keys_of(self, tensors: Iterable[Tensor]) -> set[int]:
        keys = set()
        for t in tensors:
            for storage in _storages(t):
                key = self._keys.get(storage.data_ptr())
                if key is not None:
                    keys.add(key)
        return keys


def _storages(t: Tensor) -> list[Any]:
    """The storages that hold ``t``'s data: its own; a sparse tensor's index and value tensors' (a sparse
    ``nn.Embedding``'s gradient, say); none for a wrapper tensor without storage, which is not followed."""
    if t.layout == torch.strided:
        try:
            return [t.untyped_storage()]
        except (RuntimeError, NotImplementedError):
            return []
    if t.layout == torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    else:
        return []
    return [storage for part in parts for storage in _storages(part)]
