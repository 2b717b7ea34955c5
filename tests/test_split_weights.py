"""What the first training step makes of backbone weights changed after the split (``engine/split_weights.py``),
on given per-stage answers: the processes' side is ``tests/test_trust.py`` and ``tests/test_compatibility.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.split_weights import CONSTANT, SplitWeights, judge


def test_a_stage_tells_unchanged_weights_constants_and_drawn_values_apart_and_equal_draws_give_equal_answers():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    watch = [SplitWeights(), SplitWeights()]
    assert watch[0].changed(first.parameters()) == 0 and not watch[0].watching  # nothing noted: nothing watched
    for weights, layer in zip(watch, (first, second)):
        weights.note(layer.parameters())
    assert [w.changed(layer.parameters()) for w, layer in zip(watch, (first, second))] == [0, 0]
    nn.init.zeros_(first.bias)  # a constant: no random draw makes it
    assert watch[0].changed(first.parameters()) == CONSTANT
    answers = []
    for layer, weights in zip((first, second), watch):
        torch.manual_seed(1)  # each stage draws from the same point of the stream, as after the split
        nn.init.xavier_uniform_(layer.weight)
        answers.append(weights.changed(layer.parameters()))
    assert answers[0] == answers[1] > CONSTANT  # the same values drawn: the same answer (first's bias is 0 besides)
    watch[0].note(None)
    assert not watch[0].watching and watch[0].changed(first.parameters()) == 0


def test_judge_refuses_random_changes_warns_of_possible_loads_and_passes_unchanged_weights():
    ranks = [0, 1, 2]
    assert judge([0, 0, 0], rng_apart=True, ranks=ranks, batch=0) is None
    loaded = judge([11, 0, 12], rng_apart=False, ranks=ranks, batch=0)  # other values per stage: a load, perhaps
    assert loaded is not None and "weights on stage 0 (rank 0) and stage 2 (rank 2)." in loaded
    assert "`__init__`, `setup()` or `configure_model()`" in loaded
    assert judge([CONSTANT] * 3, rng_apart=False, ranks=ranks, batch=0) is not None  # constants alike: no draw
    assert judge([7, 7, 0], rng_apart=False, ranks=ranks, batch=0) is not None  # not every stage changed
    with pytest.raises(PipelineError, match="the stages drew different amounts of random numbers"):
        judge([11, 0, 12], rng_apart=True, ranks=ranks, batch=3)
    with pytest.raises(PipelineError, match=r"batch 0, .*stage 2 \(rank 2\), and every stage's changed weights"):
        judge([7, 7, 7], rng_apart=False, ranks=ranks, batch=0)
