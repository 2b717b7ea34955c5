"""Random streams keyed by (seed, call, micro-batch, layer), independent of the caller's generator."""

import random

import numpy as np
import torch
from torch import nn

from lightning_gpipe.engine.rng import (
    HostDraws,
    generators_kept,
    host_streams,
    isolated_rng,
    layer_generators,
    layer_seed,
    seed_host,
    seed_layer,
)


def test_layer_seeds_differ_by_every_key_and_repeat_for_the_same_key():
    seeds = {layer_seed(7, c, m, i) for c in range(4) for m in range(4) for i in range(4)}
    assert len(seeds) == 64
    assert layer_seed(7, 1, 2, 3) == layer_seed(7, 1, 2, 3)
    assert all(0 <= s < 2**63 for s in seeds)


def test_isolated_rng_puts_the_callers_generator_back():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with isolated_rng(torch.device("cpu")):
        seed_layer(123, torch.device("cpu"))
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    with isolated_rng(torch.device("cpu")):
        seed_layer(123, torch.device("cpu"))
        assert torch.equal(torch.rand(3), inside)


def test_host_streams_give_the_callers_draws_back_when_keyed_and_report_a_draw_when_not():
    random.seed(0)
    np.random.seed(0)
    expected = random.random(), np.random.uniform()
    random.seed(0)
    np.random.seed(0)
    with host_streams(keyed=True, drew=lambda: "unused"):
        seed_host(123)
        inside = random.random(), np.random.uniform()
        seed_host(123)
        assert (random.random(), np.random.uniform()) == inside  # the same key, the same draws
        seed_host(124)
        assert (random.random(), np.random.uniform()) != inside
    assert (random.random(), np.random.uniform()) == expected
    calls = []
    with host_streams(keyed=False, drew=lambda: calls.append("drew")):
        torch.rand(2)  # torch's generator is another matter (isolated_rng)
    assert calls == []
    for draw in (random.random, np.random.uniform):
        with host_streams(False, lambda: calls.append("drew")):
            draw()
    assert calls == ["drew", "drew"]  # and the draws stand: another thread's may have been among them
    assert (random.random(), np.random.uniform()) != expected


def test_host_draws_key_every_layer_in_a_modes_first_call_then_only_where_a_layer_drew():
    draws = HostDraws()
    training, evaluation = (True, True), (False, False)
    assert draws.learning(training) and draws.keyed(training) and draws.keyed(evaluation)
    draws.learnt(training, [3, 1, 3])
    assert not draws.learning(training) and draws.keyed(training) and draws.drawing(training) == [1, 3]
    draws.learnt(evaluation, [])
    assert not draws.keyed(evaluation) and draws.keyed((True, False))
    assert draws.draws_from_now_on(evaluation, [0, 1]) and draws.keyed(evaluation)
    assert not draws.draws_from_now_on(evaluation, [0, 1])  # no news the second time


def test_layer_generators_finds_every_kind_a_layer_draws_from_and_puts_each_back():
    layer = nn.Linear(2, 2)
    layer.inner = nn.Module()
    layer.torch_generator = torch.Generator().manual_seed(1)
    layer.python = random.Random(2)
    layer.inner.numpy = np.random.default_rng(3)
    layer.inner.legacy = np.random.RandomState(4)
    layer.system = random.SystemRandom()  # the OS's entropy: nothing to put back
    found = layer_generators(layer)
    assert [type(g.generator) for g in found] == [
        torch.Generator,
        random.Random,
        np.random.Generator,
        np.random.RandomState,
    ]

    def draws():
        return (
            torch.rand(1, generator=layer.torch_generator).item(),
            layer.python.random(),
            layer.inner.numpy.random(),
            layer.inner.legacy.rand(),
        )

    with generators_kept(layer):
        first = draws()
    assert draws() == first
