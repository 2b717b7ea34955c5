"""Gradient-norm clipping over the whole pipeline: one norm for all stages, each parameter counted once."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.engine.clipping import clip_grad_norm_, global_grad_norm
from lightning_gpipe.launch import run_ok


def _params(*sizes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for size in sizes:
        p = nn.Parameter(torch.randn(size, generator=generator))
        p.grad = torch.randn(size, generator=generator) * 3
        params.append(p)
    return params


def _norm(params):
    return torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)


def _clones(params):
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for copy, p in zip(copies, params):
        copy.grad = None if p.grad is None else p.grad.clone()
    return copies


def test_norm_counts_the_stages_own_and_the_replicated_parameters():
    own, replicated = _params(5, (3, 4)), _params(2, 6, seed=1)
    total = global_grad_norm(own + replicated, own, count_replicated=True, group=None)
    torch.testing.assert_close(total, _norm(own + replicated), atol=1e-6, rtol=1e-7)
    assert total.dtype == torch.float32 and total.dim() == 0


def test_norm_leaves_the_replicated_parameters_to_the_stage_that_counts_them():
    own, replicated = _params(5, (3, 4)), _params(2, 6, seed=1)
    total = global_grad_norm(own + replicated, own, count_replicated=False, group=None)
    torch.testing.assert_close(total, _norm(own), atol=1e-6, rtol=1e-7)
    alone = global_grad_norm(replicated, own, count_replicated=True, group=None)  # a stage with no own gradient
    torch.testing.assert_close(alone, _norm(replicated), atol=1e-6, rtol=1e-7)


def test_norm_skips_the_parameters_counted_elsewhere():
    own, copies = _params(5, 7), _params(7, seed=2)  # a tied copy an earlier stage holds (and counts) too
    total = global_grad_norm(own + copies, own + copies, True, None, counted_elsewhere=copies)
    torch.testing.assert_close(total, _norm(own), atol=1e-6, rtol=1e-7)


def test_norm_ignores_parameters_without_gradient_and_is_zero_without_any():
    own = _params(5, 3)
    frozen = nn.Parameter(torch.ones(100))
    total = global_grad_norm([*own, frozen], [*own, frozen], True, None)
    torch.testing.assert_close(total, _norm(own), atol=1e-6, rtol=1e-7)
    none = global_grad_norm([frozen], [frozen], True, None)
    assert none.item() == 0.0 and none.device.type == "cpu"


def test_clipping_matches_torch_clip_grad_norm_on_the_same_parameters():
    own, replicated = _params(5, (3, 4)), _params(2, 6, seed=1)
    reference = _clones(own + replicated)
    for max_norm in (1.0, 1e6):  # clipped, then left alone: the factor is capped at 1
        total = clip_grad_norm_(own + replicated, max_norm, own, count_replicated=True, group=None)
        expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
        torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-7)
        for p, q in zip(own + replicated, reference):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-7)
    assert _norm(own + replicated).item() == pytest.approx(1.0, rel=1e-5)


def test_clipping_complex_gradients_matches_torch_and_returns_a_real_norm():
    # a complex weight (a spectral layer's) made the joined norm complex, and clipping failed: "clamp is not supported
    # for complex types", where torch's clip_grad_norm_ counts |g| and clips
    own = _params(4) + [nn.Parameter(torch.randn(3, dtype=torch.complex64))]
    own[-1].grad = torch.randn(3, dtype=torch.complex64) * 3
    reference = _clones(own)
    total = clip_grad_norm_(own, 1.0, own, count_replicated=True, group=None)
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    assert total.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(total, expected, atol=1e-6, rtol=1e-7)
    for p, q in zip(own, reference):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-7, rtol=1e-7)


def test_clipping_scales_every_gradient_by_the_same_factor_counted_or_not():
    own, replicated, copies = _params(5, 3), _params(4, seed=1), _params(3, seed=2)
    frozen = nn.Parameter(torch.ones(2))
    before = [p.grad.clone() for p in own + replicated + copies]
    counted = _norm(own)
    parameters = iter([*own, *replicated, *copies, frozen])  # any iterable, read once
    total = clip_grad_norm_(parameters, 0.5, own + copies, count_replicated=False, group=None, counted_elsewhere=copies)
    torch.testing.assert_close(total, counted, atol=1e-6, rtol=1e-7)
    factor = 0.5 / (total + 1e-6)  # torch's clip_grads_with_norm_
    for p, old in zip(own + replicated + copies, before):  # the copies and the replicated ones too
        torch.testing.assert_close(p.grad, old * factor, atol=1e-7, rtol=1e-6)
    assert frozen.grad is None


# -- two stages ------------------------------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model):
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    (model(x).square().sum() * 10).backward()


def _clip_half(rank, world_size, max_norm):
    """Each rank holds half of the model plus the head (model[4]), replicated; rank 1 a tied copy of model[0]."""
    dist.init_process_group("gloo")
    model = _model()
    _backward(model)  # the one-device gradients: what the stages' drains and the replicated head compute
    own = list(model[0].parameters()) if rank == 0 else list(model[2].parameters())
    head = list(model[4].parameters())
    copies = [] if rank == 0 else _clones([model[0].weight])  # the tie's copy on the later stage
    total = clip_grad_norm_(
        own + head + copies,
        max_norm,
        own + copies,
        count_replicated=rank == 0,
        group=dist.group.WORLD,
        counted_elsewhere=copies,
    )
    return {
        "total": total,
        "own": [p.grad for p in own],
        "head": [p.grad for p in head],
        "copies": [p.grad for p in copies],
    }


def test_two_stages_holding_halves_of_a_model_clip_exactly_like_one_process_clipping_the_whole_model():
    results = run_ok(_clip_half, 2, 0.5, timeout=120)
    model = _model()
    _backward(model)
    expected_total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    assert expected_total.item() > 5  # so the gradients are scaled, by a factor far from 1
    for rank, layer in ((0, model[0]), (1, model[2])):
        result = results[rank]
        torch.testing.assert_close(result["total"], expected_total, atol=1e-5, rtol=1e-6)
        for got, p in zip(result["own"], layer.parameters()):
            torch.testing.assert_close(got, p.grad, atol=1e-7, rtol=1e-6)
        for got, p in zip(result["head"], model[4].parameters()):  # the replicated head alike on both ranks
            torch.testing.assert_close(got, p.grad, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(results[1]["copies"][0], model[0].weight.grad, atol=1e-7, rtol=1e-6)
    assert torch.equal(results[0]["total"], results[1]["total"])  # one norm on every stage
