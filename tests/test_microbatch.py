"""Micro-batching: scatter a batch into `chunks` pieces (fewer for a smaller batch) and gather outputs back."""

import collections
import dataclasses

import numpy
import pytest
import torch

from lightning_gpipe.engine import microbatch


def test_split_sizes_are_as_even_as_possible_and_never_empty():
    assert microbatch.split_sizes(10, 4) == [3, 3, 2, 2]
    assert microbatch.split_sizes(9, 4) == [3, 2, 2, 2]  # torch.chunk would give only 3 pieces
    assert microbatch.split_sizes(8, 8) == [1] * 8


def test_batch_smaller_than_chunks_gets_one_micro_batch_per_sample():
    assert microbatch.split_sizes(3, 4) == [1, 1, 1]
    assert microbatch.split_sizes(1, 4) == [1]
    assert [t.shape[0] for t in microbatch.scatter(torch.zeros(2, 3), 4)] == [1, 1]


def test_empty_batch_is_rejected_with_what_to_check():
    with pytest.raises(ValueError, match=r"The batch has 0 samples; every micro-batch needs at least one sample"):
        microbatch.split_sizes(0, 4)


@pytest.mark.parametrize("chunks", [0, -1])
def test_non_positive_chunks_is_rejected(chunks):
    with pytest.raises(ValueError, match="`chunks` must be a positive integer"):
        microbatch.split_sizes(8, chunks)


def test_scatter_keeps_the_structure_of_tuples_lists_dicts_and_namedtuples():
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": torch.arange(10), "pair": Pair(torch.ones(10, 2), [torch.zeros(10), "tag"])}
    parts = microbatch.scatter(batch, 3)
    assert len(parts) == 3
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert isinstance(parts[1]["pair"], Pair)
    assert parts[2]["pair"].b[1] == "tag"  # non-tensor leaves go to every micro-batch
    assert parts[2]["pair"].b[0].shape == (3,)


def test_batch_size_rejects_disagreeing_tensors_and_tensorless_batches():
    with pytest.raises(ValueError, match="disagree on the batch size"):
        microbatch.batch_size((torch.zeros(4), torch.zeros(5)))
    with pytest.raises(ValueError, match="holds no tensor"):
        microbatch.batch_size(["a", 3])
    with pytest.raises(ValueError, match="0-dimensional"):
        microbatch.batch_size(torch.tensor(1.0))


def test_a_fingerprint_reads_a_sparse_tensor_by_its_indices_and_values_and_a_nested_one_by_its_components():
    x = torch.eye(4).to_sparse()
    assert microbatch.fingerprint((x, 1)) == microbatch.fingerprint((torch.eye(4).to_sparse(), 1))
    assert microbatch.fingerprint(x) != microbatch.fingerprint((2 * torch.eye(4)).to_sparse())  # other values
    assert microbatch.fingerprint(x) != microbatch.fingerprint(torch.eye(4).flip(0).to_sparse())  # other places
    # a nested tensor: by its components, whose shapes count (the same values, cut 2 + 3 or 3 + 2, differ)
    values = torch.arange(15.0).view(5, 3)
    two_three = torch.nested.nested_tensor([values[:2], values[2:]])
    assert microbatch.fingerprint(two_three) == microbatch.fingerprint(
        torch.nested.nested_tensor([values[:2], values[2:]])
    )
    assert microbatch.fingerprint(two_three) != microbatch.fingerprint(
        torch.nested.nested_tensor([values[:3], values[3:]])
    )
    with pytest.raises(ValueError, match="The backbone input holds a nested tensor, which the pipeline can neither"):
        microbatch.batch_size(two_three)


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_batch_size_refuses_a_sparse_input_naming_its_layout_and_the_fix(layout):
    # it failed in the cut with torch's "Could not run 'aten::as_strided' with arguments from the 'SparseCPU'
    # backend" (COO) or "Sparse CSR tensors do not have strides", also with chunks=1
    x = torch.eye(4)
    x = x.to_sparse() if layout == "sparse_coo" else x.to_sparse_csr()
    with pytest.raises(ValueError, match=f"holds a tensor of layout torch.{layout}, which the pipeline can neither"):
        microbatch.batch_size((x, torch.zeros(4)))


@pytest.mark.parametrize("lengths", [[3, 1], [1]])  # [1]: every field has 1 row, so the sizes agree
def test_batch_size_refuses_a_packed_sequence_which_cannot_be_cut_into_samples(lengths):
    padded = torch.zeros(3, len(lengths), 4)
    packed = torch.nn.utils.rnn.pack_padded_sequence(padded, lengths, enforce_sorted=False)
    with pytest.raises(ValueError, match="holds a PackedSequence, whose `data` packs every sample"):
        microbatch.batch_size({"tokens": packed})


def test_gather_concatenates_each_output_of_a_tuple():
    outs = [(torch.full((2, 3), float(i)), torch.full((2,), i)) for i in range(3)]
    joined = microbatch.gather(outs)
    assert joined[0].shape == (6, 3) and joined[1].tolist() == [0, 0, 1, 1, 2, 2]


def test_fingerprint_tells_apart_another_sample_another_order_a_flip_and_another_dtype():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 4, 4, generator=generator), torch.randint(0, 5, (8,), generator=generator)
    reference = microbatch.fingerprint((x, y))
    assert microbatch.fingerprint((x.clone(), y.clone())) == reference  # the same values in other memory
    others = [
        (x[torch.randperm(8, generator=generator)], y),
        (x.flip(-1), y),
        (x, (y + 1) % 5),
        (x.double(), y),
        (x[:7], y[:7]),
        (x.reshape(8, 48), y),
        {"x": x},
    ]
    assert len({reference, *(microbatch.fingerprint(b) for b in others)}) == len(others) + 1


def test_fingerprint_covers_every_dtype_a_batch_may_hold_and_lazy_conjugate_views():
    for dtype in (torch.float16, torch.bfloat16, torch.bool, torch.uint8, torch.int32, torch.complex64):
        t = torch.ones(4, 2).to(dtype)
        assert microbatch.fingerprint(t) == microbatch.fingerprint(t.clone()) != 0
    # lazy conjugate and negative views (`x.conj()`, a conjugate's `.imag`): read by their values; the conjugate
    # failed with "view_as_real doesn't work on unresolved conjugated tensors"
    x = torch.tensor([1 + 2j, 3 - 1j])
    assert (
        microbatch.fingerprint(x.conj()) == microbatch.fingerprint(x.conj().resolve_conj()) != microbatch.fingerprint(x)
    )
    assert microbatch.fingerprint(x.conj().imag) == microbatch.fingerprint(x.conj().imag.resolve_neg())


def test_fingerprints_of_several_tensors_are_each_tensors_own_fingerprint():
    # the strategy compares a stage's parameters one by one (which changed) from one pass over all of them
    parts = [torch.randn(3, 4), torch.arange(5), torch.zeros(0), torch.randn(2, 2).t(), torch.tensor(1.5)]
    got = microbatch.fingerprints(parts)
    assert got == [microbatch.fingerprint(t) for t in parts] and len(set(got)) == len(parts)


@dataclasses.dataclass
class Batch:
    """A batch as a dataclass, as Lightning moves it to the device: tensors and a list of strings."""

    images: torch.Tensor
    labels: torch.Tensor
    names: list


class _BatchObject:
    """A batch class of a user's, neither a container nor a dataclass: Lightning moves it through its ``to``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels, self.itself = images, labels, self  # a reference back: the walk must end

    def to(self, device: torch.device) -> "_BatchObject":
        return _BatchObject(self.images.to(device), self.labels.to(device))


def test_the_fingerprint_reads_the_tensors_inside_a_batch_object_of_the_users():
    # it read only the class's name: stages given different tensors in such an object went on unchecked
    batch = _BatchObject(torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 2]))
    assert microbatch.fingerprint(batch) == microbatch.fingerprint(_BatchObject(batch.images.clone(), batch.labels))
    assert microbatch.fingerprint(batch) != microbatch.fingerprint(_BatchObject(batch.images + 1, batch.labels))
    assert microbatch.fingerprint([batch]) != microbatch.fingerprint([_BatchObject(batch.images, batch.labels + 1)])


def test_dataclass_batches_split_by_field_and_their_strings_and_numbers_count_in_the_fingerprint():
    batch = Batch(torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 2]), ["a", "b", "c"])
    first, second = microbatch.scatter(batch, 2)
    assert type(first) is Batch and first.labels.tolist() == [0, 1] and second.images.tolist() == [[4.0, 5.0]]
    assert first.names == ["a", "b", "c"] and microbatch.batch_size(batch) == 3
    same = Batch(batch.images.clone(), batch.labels.clone(), ["a", "b", "c"])
    assert microbatch.fingerprint(same) == microbatch.fingerprint(batch)
    assert microbatch.fingerprint(Batch(batch.images + 1, batch.labels, batch.names)) != microbatch.fingerprint(batch)
    # the stages must agree on what is not a tensor too: a text batch's strings, a count, a NumPy array
    assert microbatch.fingerprint(Batch(batch.images, batch.labels, ["a", "b", "d"])) != microbatch.fingerprint(batch)
    assert microbatch.fingerprint((torch.ones(2), 3)) != microbatch.fingerprint((torch.ones(2), 4))
    assert microbatch.fingerprint((torch.ones(2), 3.0)) != microbatch.fingerprint((torch.ones(2), 3))
    numbers = numpy.arange(4)
    assert microbatch.fingerprint([numbers]) == microbatch.fingerprint([numbers.copy()])
    assert microbatch.fingerprint([numbers]) != microbatch.fingerprint([numbers[::-1].copy()])
