"""A resumable copy of the training DataLoader: same batches as an uninterrupted run after a mid-epoch restore."""

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

from lightning_gpipe.checkpointing.resumable import resumable

CPU = torch.device("cpu")
BATCHES = 7  # 20 samples in batches of 3, the last one short


def _dataset():
    return TensorDataset(torch.arange(20))


def _loader(**kwargs):
    return DataLoader(_dataset(), batch_size=3, shuffle=True, **kwargs)


def _ids(batches):
    return [batch[0].tolist() for batch in batches]


def _uninterrupted(epochs, seed=0):
    """The batches of each epoch, and the numbers a training step draws after each batch."""
    torch.manual_seed(seed)
    loader = _loader()
    batches, draws = [], []
    for _ in range(epochs):
        for batch in loader:
            batches.append(batch[0].tolist())
            draws.append(torch.rand(1).item())  # dropout, say
    return batches, draws


class _Counter:
    def __init__(self):
        self.count = 0

    def __call__(self):
        return self.count


def _stop_after(n, seed=0, loader=None):
    """Train ``n`` batches of the first epoch from ``seed``; the loader's position then."""
    torch.manual_seed(seed)
    consumed = _Counter()
    copy = resumable(loader if loader is not None else _loader(), consumed, CPU)
    iterator = iter(copy)
    for _ in range(n):
        next(iterator)
        torch.rand(1)
        consumed.count += 1
    return copy.position()


def test_restore_mid_epoch_yields_exactly_the_remaining_batches_in_the_same_order():
    expected, _ = _uninterrupted(1)
    for n in (1, 3, BATCHES - 1):
        position = _stop_after(n)
        torch.manual_seed(1234)  # a new process: another random state
        fresh = resumable(_loader(), lambda: 0, CPU)
        fresh.restore(position)
        assert _ids(fresh) == expected[n:], n


def test_resumed_run_draws_the_same_numbers_and_the_next_epochs_order_as_an_uninterrupted_run():
    expected_batches, expected_draws = _uninterrupted(2)
    n = 4
    position = _stop_after(n)
    torch.manual_seed(99)
    fresh = resumable(_loader(), lambda: 0, CPU)
    fresh.restore(position)
    batches, draws = [], []
    for _ in range(2):
        for batch in fresh:
            fresh.restore_random_state()  # before every training step, as the strategy calls it
            batches.append(batch[0].tolist())
            draws.append(torch.rand(1).item())
    assert batches == expected_batches[n:]
    assert draws == expected_draws[n:]


def test_restore_after_a_complete_epoch_goes_on_with_the_next_epochs_order():
    expected, _ = _uninterrupted(2)
    position = _stop_after(BATCHES)
    assert position["consumed"] == position["length"] == BATCHES
    torch.manual_seed(5)
    fresh = resumable(_loader(), lambda: 0, CPU)
    fresh.restore(position)
    assert _ids(fresh) == expected[BATCHES:]
    assert fresh.pending_random_state is None  # nothing left to put back: the state was restored at once


def test_restore_applies_to_the_next_epoch_only():
    position = _stop_after(2)
    fresh = resumable(_loader(), lambda: 0, CPU)
    fresh.restore(position)
    assert len(_ids(fresh)) == BATCHES - 2
    assert sorted(i for batch in _ids(fresh) for i in batch) == list(range(20))  # then whole epochs again


def test_restore_random_state_puts_back_the_state_at_position_time_once():
    torch.manual_seed(0)
    copy = resumable(_loader(), lambda: 3, CPU)
    iterator = iter(copy)
    for _ in range(3):
        next(iterator)
        torch.rand(1)
    position = copy.position()
    expected = torch.rand(4)  # what the next training step draws
    torch.manual_seed(7)
    fresh = resumable(_loader(), lambda: 0, CPU)
    fresh.restore(position)
    next(iter(fresh))
    assert not torch.equal(torch.rand(4), expected)  # the loader drew the order from the epoch's start
    fresh.restore_random_state()
    assert torch.equal(torch.rand(4), expected)
    state = torch.get_rng_state()
    fresh.restore_random_state()  # a no-op the second time
    assert torch.equal(torch.get_rng_state(), state)


def test_restore_random_state_is_a_no_op_without_a_restore():
    fresh = resumable(_loader(), lambda: 0, CPU)
    next(iter(fresh))
    state = torch.get_rng_state()
    fresh.restore_random_state()
    assert torch.equal(torch.get_rng_state(), state)


class NamedLoader(DataLoader):
    def __init__(self, *args, name="train", **kwargs):
        super().__init__(*args, **kwargs)
        self.name = name

    def describe(self):
        return f"{self.name}: {len(self)} batches"


def test_the_copy_is_the_users_loader_class_and_the_users_loader_is_left_alone():
    loader = NamedLoader(_dataset(), batch_size=3, shuffle=True, name="mine")
    batch_sampler, sampler = loader.batch_sampler, loader.batch_sampler.sampler
    copy = resumable(loader, lambda: 2, CPU)
    assert copy is not loader and isinstance(copy, NamedLoader)
    assert copy.name == "mine" and copy.describe() == "mine: 7 batches"
    assert copy.dataset is loader.dataset
    position = _stop_after(2, loader=NamedLoader(_dataset(), batch_size=3, shuffle=True))
    copy.restore(position)
    assert len(_ids(copy)) == BATCHES - 2
    assert type(loader) is NamedLoader and not hasattr(loader, "position")
    assert loader.batch_sampler is batch_sampler and loader.batch_sampler.sampler is sampler
    assert type(sampler).__name__ == "RandomSampler"
    assert sorted(i for batch in _ids(loader) for i in batch) == list(range(20))  # a whole epoch, nothing skipped


def test_a_resumable_loader_is_not_wrapped_again():
    copy = resumable(_loader(), lambda: 0, CPU)
    assert resumable(copy, lambda: 0, CPU) is copy


def test_a_distributed_samplers_seed_is_restored_and_set_epoch_reaches_it():
    def loader(seed):
        dataset = _dataset()
        return DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 2, 0, shuffle=True, seed=seed))

    reference = loader(5)
    reference.sampler.set_epoch(1)
    expected = _ids(reference)
    copy = resumable(loader(5), lambda: 2, CPU)
    copy.batch_sampler.sampler.set_epoch(1)  # through the skipping wrapper to the user's sampler
    assert copy.sampler.epoch == 1
    iterator = iter(copy)
    next(iterator), next(iterator)
    position = copy.position()
    assert position["sampler_seed"] == 5
    fresh = resumable(loader(0), lambda: 0, CPU)
    fresh.batch_sampler.sampler.set_epoch(1)
    fresh.restore(position)
    assert _ids(fresh) == expected[2:]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_a_loader_over_an_iterable_dataset_is_returned_unchanged():
    unbatched = DataLoader(Stream(), batch_size=None)
    assert resumable(unbatched, lambda: 0, CPU) is unbatched
    # DataLoader gives an iterable dataset a plain BatchSampler over an endless sampler of `None`s: skipping
    # its indices would not skip data, and position() would need the length of a stream
    batched = DataLoader(Stream(), batch_size=2)
    assert resumable(batched, lambda: 0, CPU) is batched


class Pairs(BatchSampler):
    pass


def test_a_loader_with_a_custom_batch_sampler_is_returned_unchanged():
    dataset = _dataset()
    custom = DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]])
    assert resumable(custom, lambda: 0, CPU) is custom
    subclassed = DataLoader(dataset, batch_sampler=Pairs(SequentialSampler(dataset), 2, False))
    assert resumable(subclassed, lambda: 0, CPU) is subclassed
