"""Random streams keyed by (seed, call, micro-batch, layer), independent of the caller's generator."""

import torch

from lightning_gpipe.engine.rng import isolated_rng, layer_seed, seed_layer


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
