"""The fill-drain schedule and the re-materialization policies."""

import pytest

from lightning_gpipe.engine.checkpoint import checkpointed
from lightning_gpipe.engine.schedule import bubble_fraction, clock_cycles, fill_drain


def test_checkpoint_modes():
    assert [checkpointed("always", i, 3) for i in range(3)] == [True, True, True]
    assert [checkpointed("except_last", i, 3) for i in range(3)] == [True, True, False]
    assert [checkpointed("never", i, 3) for i in range(3)] == [False, False, False]


def test_unknown_checkpoint_mode_names_the_choices():
    with pytest.raises(ValueError, match=r"`checkpoint` must be one of \('always', 'except_last', 'never'\)"):
        checkpointed("sometimes", 0, 1)


def test_fill_drain_runs_forward_in_order_and_backward_in_reverse_with_recompute_first():
    forward, backward = fill_drain(3, "except_last")
    assert [(t.kind, t.micro) for t in forward] == [("forward", 0), ("forward", 1), ("forward", 2)]
    assert [(t.kind, t.micro) for t in backward] == [
        ("backward", 2),
        ("recompute", 1),
        ("backward", 1),
        ("recompute", 0),
        ("backward", 0),
    ]


def test_clock_cycles_form_the_diagonal_of_the_gpipe_figure():
    cycles = clock_cycles(chunks=3, stages=2)
    assert len(cycles) == 3 + 2 - 1
    assert cycles[1] == [(1, 0), (0, 1)]
    assert sorted(p for c in cycles for p in c) == [(i, s) for i in range(3) for s in range(2)]


def test_bubble_fraction():
    assert bubble_fraction(chunks=1, stages=1) == 0
    assert bubble_fraction(chunks=4, stages=2) == pytest.approx(1 / 5)
