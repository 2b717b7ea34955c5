"""A training DataLoader that restarts mid-epoch at the next unseen sample, in the same order.

Lightning resumes a plain DataLoader from the start of the epoch. Here the loader remembers the
random state at the start of each epoch; on resume it restores it, so the user's own sampler draws
the very same order, and skips what was already trained on. The sampler is the user's, untouched,
so a pipeline still sees the batches of a one-device run. (torchdata's StatefulDataLoader does this
for its own loader class; this works for any DataLoader the user already has.)
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from lightning_gpipe._subclass import copy_as
from lightning_gpipe.engine.rng import RandomState, get_rng_state, set_rng_state

__all__ = ["resumable"]


class _Skipping(Sampler):
    """The inner sampler, minus the first ``skip`` indices of the next epoch only."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.skip = inner, 0

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip = self.skip, 0
        iterator = iter(self.inner)
        for _ in range(skip):
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # set_epoch and the like reach the user's sampler
        return getattr(self.__dict__["inner"], name)


class _Resumable:
    """Mixed into the user's DataLoader class: it can say and restore where training stands in the epoch.

    Not Lightning's ``state_dict`` protocol for stateful loaders: a checkpoint that holds a loader state
    cannot be resumed by a one-device run whose loader has none, and these checkpoints must be.
    """

    batch_sampler: Any
    _consumed: Callable[[], int]
    _device: torch.device
    _epoch_state: Optional[RandomState]
    _pending: Optional[dict[str, Any]]
    pending_random_state: Optional[RandomState]

    def __iter__(self) -> Any:
        pending, self._pending = self._pending, None
        sampler = self.batch_sampler.sampler
        if pending is not None:
            if pending.get("sampler_seed") is not None:  # a DistributedSampler shuffles from its own seed
                sampler.inner.seed = pending["sampler_seed"]
            complete = pending["consumed"] >= pending["length"]
            # an unfinished epoch draws its order again from where it started; a finished one goes on
            set_rng_state(pending["random_now" if complete else "random_at_epoch_start"], self._device)
            if not complete:
                sampler.skip = pending["consumed"] * self.batch_sampler.batch_size
                self.pending_random_state = pending["random_now"]  # restored before the next training step
        self._epoch_state = get_rng_state(self._device)
        return super().__iter__()  # type: ignore[misc]  # the user's DataLoader class comes next in the MRO

    def position(self) -> dict[str, Any]:
        """Where training stands in the epoch, and the random states to replay it from."""
        return {
            "consumed": self._consumed(),
            "length": len(self),  # type: ignore[arg-type]
            "random_at_epoch_start": self._epoch_state,
            "random_now": get_rng_state(self._device),
            "sampler_seed": getattr(self.batch_sampler.sampler.inner, "seed", None),
        }

    def restore(self, position: dict[str, Any]) -> None:
        """Start the next epoch where :meth:`position` stood (once)."""
        self._pending = position

    def restore_random_state(self) -> None:
        """After a mid-epoch resume, before its first step: the random state as it was when the checkpoint was
        taken (the loader drew the epoch's order from an earlier one). Once; a no-op otherwise."""
        if self.pending_random_state is not None:
            set_rng_state(self.pending_random_state, self._device)
            self.pending_random_state = None


def resumable(loader: DataLoader, consumed: Callable[[], int], device: torch.device) -> DataLoader:
    """A copy of ``loader`` whose position in the epoch can be saved and restored.

    ``consumed()`` says how many batches of the current epoch were trained on (the prefetching of
    the loop makes the loader's own count run ahead). Loaders without a plain batch sampler (an
    iterable dataset, a custom batch sampler) are returned unchanged.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    if type(batch_sampler) is not torch.utils.data.BatchSampler or hasattr(loader, "pending_random_state"):
        return loader
    if isinstance(loader.dataset, IterableDataset):  # its batch sampler draws `None`s: skipping them skips no data
        return loader
    new = copy_as(loader, _Resumable)
    skipping = copy.copy(batch_sampler)
    skipping.sampler = _Skipping(batch_sampler.sampler)
    new.__dict__["batch_sampler"] = skipping  # DataLoader.__setattr__ refuses this after __init__
    new._consumed, new._device = consumed, device
    new._epoch_state = new._pending = new.pending_random_state = None
    return new
