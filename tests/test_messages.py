"""The message header that announces tensors between stages, and says what each message is."""

import pytest
import torch

from lightning_gpipe import PipelineError
from lightning_gpipe.engine.lockstep import check_message
from lightning_gpipe.engine.messages import HEADER_LEN, Message, Tag, decode, encode


def test_header_round_trips_shapes_dtypes_grad_flags_missing_entries_and_the_tag():
    values = (torch.zeros(2, 3), None, torch.zeros(4, dtype=torch.int64), torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16))
    tag = Tag("gradient", call=(1 << 62) + 5, micro=3, label="on_validation_batch_end", batch=0x7FFF_0000_1234_5678)
    header = encode(values, [True, False, False, True], is_tuple=True, tag=tag)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    specs, got, is_tuple = decode(header)
    assert specs == [
        (torch.float32, True, (2, 3)),
        (None, False, ()),
        (torch.int64, False, (4,)),
        (torch.bfloat16, True, (1, 2, 3, 4)),
    ]
    assert got == tag and is_tuple


def test_a_long_label_is_cut_to_48_characters():
    label = "x" * 60
    _, got, _ = decode(encode([torch.zeros(1)], [False], False, Tag("forward", 0, 0, label)))
    assert got.label == "x" * 48


def test_header_overflow_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit"):
        encode([torch.zeros(1, 1, 1, 1, 1)] * 20, [False] * 20, is_tuple=True, tag=Tag("forward", 0, 0))


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="dtype torch.float8"):
        encode([torch.zeros(2).to(torch.float8_e4m3fn)], [False], is_tuple=False, tag=Tag("forward", 0, 0))


def _message(tag: Tag) -> Message:
    return Message((torch.zeros(1),), (False,), False, tag)


def test_a_message_of_another_call_or_hook_is_an_out_of_step_error_naming_both():
    expected = Tag("forward", 7, 0, "training_step", batch=11)
    with pytest.raises(
        PipelineError,
        match=r"fell out of step: stage 1 expected the forward of micro-batch 0 of "
        r"backbone call 7 \(made in `training_step`\) from stage 0 \(rank 0\), "
        r"but received the forward of micro-batch 0 of backbone call 7 \(made "
        r"in `on_train_batch_end`\).*@rank_zero_only",
    ):
        check_message(_message(Tag("forward", 7, 0, "on_train_batch_end", batch=11)), expected, "stage 0 (rank 0)", 1)
    with pytest.raises(PipelineError, match="received the output of backbone call 6"):
        check_message(_message(Tag("output", 6)), Tag("output", 7), "stage 1 (rank 1)", 0)


def test_a_forward_from_a_stage_with_another_batch_names_both_stages_and_the_fixes():
    expected = Tag("forward", 2, 1, "training_step", batch=0x1234)
    with pytest.raises(
        PipelineError,
        match=r"stage 1 \(rank 1\) and stage 2 hold different batches in backbone "
        r"call 2 \(made in `training_step`\).*seed_everything.*IterableDataset",
    ):
        check_message(_message(Tag("forward", 2, 1, "training_step", batch=0x4321)), expected, "stage 1 (rank 1)", 2)
    same = _message(Tag("forward", 2, 1, "training_step", batch=0x1234))
    assert check_message(same, expected, "stage 1 (rank 1)", 2) is same
