"""The message header that announces tensors between stages."""

import pytest
import torch

from lightning_gpipe.comm import HEADER_LEN, decode, encode


def test_header_round_trips_shapes_dtypes_grad_flags_and_missing_entries():
    values = (torch.zeros(2, 3), None, torch.zeros(4, dtype=torch.int64), torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16))
    header = encode(values, [True, False, False, True], is_tuple=True)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    assert decode(header) == [(torch.float32, True, (2, 3)), (None, False, ()), (torch.int64, False, (4,)),
                              (torch.bfloat16, True, (1, 2, 3, 4))]


def test_header_overflow_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit"):
        encode([torch.zeros(1, 1, 1, 1, 1)] * 20, [False] * 20, is_tuple=True)


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="dtype torch.float8"):
        encode([torch.zeros(2).to(torch.float8_e4m3fn)], [False], is_tuple=False)
