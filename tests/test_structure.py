"""What crosses a stage boundary: flatten a stage output to its tensors and a structure, and rebuild it."""

import collections
import dataclasses
import types

import pytest
import torch

from lightning_gpipe.engine import microbatch, structure

Pair = collections.namedtuple("Pair", "a b")  # at module level: another process unpickles it by name


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A layer's output as a frozen dataclass, with a field that ``__init__`` does not take."""

    hidden: torch.Tensor
    mask: torch.Tensor | None
    steps: int = 0
    kind: str = dataclasses.field(default="enc", init=False)


def test_flatten_takes_tensors_in_tuples_lists_and_dicts_with_constants_and_unflatten_rebuilds_them():
    x, h = torch.zeros(2, 3), torch.ones(2, 4)
    assert structure.flatten(x) == ((x,), False) and structure.flatten((x, h)) == ((x, h), True)
    encoded = Encoded(x, None, steps=2)
    for output in [(x, (h, h)), [x, h], {"h": x, "mask": None, "n": 3}, (x, None), Pair(x, h), ((x,),), encoded]:
        values, shape = structure.flatten(output)
        assert isinstance(shape, structure.Skeleton) and len(values) == len(microbatch.tensors(output))
        rebuilt = structure.unflatten([v + 1 for v in values], shape)
        assert type(rebuilt) is type(output) and str(microbatch.map_tensors(lambda t: t - 1, rebuilt)) == str(output)
    assert structure.flatten((encoded, Encoded(h, x)))[1].constants() == [None, 2, "enc", 0, "enc"]
    with pytest.raises(TypeError, match="got a SimpleNamespace; a stage must return Tensors, or tuples, lists, dicts"):
        structure.flatten(types.SimpleNamespace(x=x))
    with pytest.raises(TypeError, match=r"got a tuple holding a object"):
        structure.flatten((x, object()))
    with pytest.raises(TypeError, match=r"got a tuple without a tensor"):
        structure.flatten((None, 3))
    assert structure.flatten({"h": x, "pair": (None, 0.5), "name": "x"})[1].constants() == [None, 0.5, "x"]
    Local = collections.namedtuple("Local", "a")  # made in a function: another process cannot find it by name
    with pytest.raises(TypeError, match="got a Local that cannot be pickled"):
        structure.flatten(Local(x))


def test_crosses_what_a_stage_can_send_with_the_samples_in_dim_0_of_every_tensor():
    x = torch.zeros(4, 3)
    assert structure.crosses(x, 4) and structure.crosses((x, x[:, 0]), 4)
    assert structure.crosses((x, (x, x)), 4) and structure.crosses({"x": x, "mask": None}, 4)
    assert not structure.crosses(x.t(), 4) and not structure.crosses(x.sum(), 4)  # samples not in dim 0
    assert not structure.crosses((x, (x.t(), x)), 4)  # an LSTM's (output, (h, c)) with h and c sequence first
    assert not structure.crosses((x, object()), 4) and not structure.crosses(None, 4)
