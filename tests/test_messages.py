"""The message header that announces tensors between stages, and says what each message is."""

import pytest
import torch

from lightning_gpipe import PipelineError
from lightning_gpipe.engine.lockstep import check_message
from lightning_gpipe.engine.messages import (
    HEADER_BYTES,
    HEADER_LEN,
    INLINE_LIMIT,
    Message,
    Tag,
    decode,
    encode,
    frames,
    inline_values,
    is_inline,
)


def test_header_round_trips_shapes_dtypes_grad_flags_missing_entries_and_the_tag():
    values = (torch.zeros(2, 3), None, torch.zeros(4, dtype=torch.int64), torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16))
    tag = Tag("gradient", call=(1 << 62) + 5, micro=3, label="on_validation_batch_end", batch=0x7FFF_0000_1234_5678)
    header = encode(values, [True, False, False, True], structure=True, tag=tag)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    specs, got, structure = decode(header)
    assert specs == [
        (torch.float32, True, (2, 3)),
        (None, False, ()),
        (torch.int64, False, (4,)),
        (torch.bfloat16, True, (1, 2, 3, 4)),
    ]
    assert got == tag and structure


def test_a_tag_names_evaluation_calls_by_their_own_count_not_the_offset_that_keeps_them_apart():
    # an out-of-step error for a rank-zero-only forward in a validation hook read "backbone call 4611686018427387906"
    from lightning_gpipe.engine.messages import EVAL_CALLS

    assert Tag("forward", EVAL_CALLS + 2, 0, "on_validation_epoch_end").describe() == (
        "the forward of micro-batch 0 of evaluation call 2 (without a graph) (made in `on_validation_epoch_end`)"
    )
    assert Tag("gradient", 7, 1).describe() == "the gradient of micro-batch 1 of backbone call 7"


def test_a_structure_rides_in_the_header_after_the_specs_in_either_framing_and_a_large_one_is_a_clear_error():
    from lightning_gpipe.engine.structure import flatten, unflatten

    output = {"h": torch.randn(2, 3), "state": (torch.randn(2, 4), None), "scale": 0.5, "name": "block 3"}
    values, structure = flatten(output)
    tag = Tag("forward", 1, 0, "training_step")
    _, got, decoded = decode(encode(values, [True, False], structure, tag))
    assert got == tag and decoded == structure
    (frame,) = frames(values, [True, False], structure, tag, INLINE_LIMIT)
    specs, _, inline = decode(frame[:HEADER_BYTES].view(torch.int64))
    rebuilt = unflatten(inline_values(frame, specs, torch.device("cpu")), inline)
    assert rebuilt["scale"] == 0.5 and rebuilt["state"][1] is None and torch.equal(rebuilt["state"][0], values[1])
    _, large = flatten({"x": torch.zeros(1), "notes": "x" * 1000})
    with pytest.raises(ValueError, match="does not fit.*less structure"):
        encode([torch.zeros(1)], [False], large, tag)


def test_a_long_label_is_cut_to_48_characters():
    label = "x" * 60
    _, got, _ = decode(encode([torch.zeros(1)], [False], False, Tag("forward", 0, 0, label)))
    assert got.label == "x" * 48


def test_header_overflow_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit"):
        encode([torch.zeros(1, 1, 1, 1, 1)] * 20, [False] * 20, structure=True, tag=Tag("forward", 0, 0))


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="dtype torch.float8"):
        encode([torch.zeros(2).to(torch.float8_e4m3fn)], [False], structure=False, tag=Tag("forward", 0, 0))


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


def test_small_messages_travel_inline_in_one_frame_and_large_ones_in_a_frame_per_tensor():
    tag = Tag("forward", 1, 0)
    small = frames((torch.zeros(4), None, torch.ones(2, dtype=torch.int8)), [True, False, False], True, tag, 1024)
    assert len(small) == 1 and is_inline(small[0][:HEADER_BYTES].view(torch.int64))
    big = torch.zeros(257)  # 1028 bytes: over a 1024-byte limit
    assert [f.numel() for f in frames((big,), [False], False, tag, 1024)] == [HEADER_LEN, 257]
    assert len(frames((torch.zeros(4),), [False], False, tag, inline_limit=0)) == 2  # NCCL: never inline


def test_an_inline_frame_carries_every_dtype_shape_and_gap_bit_for_bit():
    values = (
        torch.randn(3, 5),
        None,
        torch.tensor(1.5, dtype=torch.float64),
        torch.zeros(0, 3),
        torch.tensor([True, False]),
        torch.randn(3).to(torch.complex128),
        torch.arange(3, dtype=torch.int16),
    )
    (frame,) = frames(values, [True] + [False] * 6, True, Tag("gradient", 2, 1), INLINE_LIMIT)
    specs, tag, structure = decode(frame[:HEADER_BYTES].view(torch.int64))
    got = inline_values(frame, specs, torch.device("cpu"))
    assert tag == Tag("gradient", 2, 1) and structure and [f for _, f, _ in specs] == [True] + [False] * 6
    for value, arrived in zip(values, got):
        if value is None:
            assert arrived is None
        else:
            assert arrived.dtype == value.dtype and arrived.shape == value.shape and torch.equal(arrived, value)


def test_lazy_conjugate_and_negative_views_travel_by_their_values_in_either_framing():
    # `z.conj()` and a conjugate's `.imag` keep their values unconjugated and unnegated in memory, with a flag: the
    # inline framing failed ("view is not supported for conjugate view tensors") and a frame per tensor carried
    # the memory, so the next stage would have received the wrong values
    z = torch.tensor([1 + 2j, 3 - 1j])
    values = (z.conj(), z.conj().imag)
    assert values[0].is_conj() and values[1].is_neg()
    tag = Tag("forward", 0, 0)
    (frame,) = frames(values, [False, False], True, tag, INLINE_LIMIT)
    specs, _, _ = decode(frame[:HEADER_BYTES].view(torch.int64))
    inline = inline_values(frame, specs, torch.device("cpu"))
    _, *apart = frames(values, [False, False], True, tag, inline_limit=0)
    for got in (inline, apart):
        assert torch.equal(got[0], torch.tensor([1 - 2j, 3 + 1j])) and not got[0].is_conj()
        assert torch.equal(got[1], torch.tensor([-2.0, 1.0])) and not got[1].is_neg()
        # what a send reads is the memory: it must hold the values themselves
        assert torch.equal(torch.view_as_real(got[0]).flatten(), torch.tensor([1.0, -2.0, 3.0, 1.0]))


def test_messages_of_every_framing_cross_a_real_gloo_pair_unchanged():
    from _engine_workers import wire_messages, wire_round_trip

    from lightning_gpipe.launch import run_ok

    (sent,), got = run_ok(wire_round_trip, 2, timeout=120)
    expected = wire_messages()
    assert len(got) == len(expected)
    for micro, ((values, flags, structure), (arrived, arrived_flags, arrived_structure, tag)) in enumerate(
        zip(expected, got)
    ):
        assert tag == Tag("forward", 4, micro, "training_step", batch=77)
        assert list(arrived_flags) == flags and arrived_structure == structure
        for value, received in zip(values, arrived):
            assert (
                (received is None) if value is None else torch.equal(received, value) and received.dtype == value.dtype
            )
    assert sent == {1: sum(v.numel() * v.element_size() for m in expected for v in m[0] if v is not None)}
