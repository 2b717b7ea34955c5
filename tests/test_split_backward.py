"""Input gradients first in the drain (``split_backward=True``): the same training as one device, activation
gradients computed once."""

from __future__ import annotations

import copy
import itertools

import _skip_workers as S
import _split_workers as W
import pytest
import torch
from test_skip_fidelity import _assert_same
from torch import nn

from lightning_gpipe import GPipe, GPipeStrategy
from lightning_gpipe.engine.split_backward import inputs_first
from lightning_gpipe.launch import run_ok


class Odd(nn.Module):
    """Parameters in the awkward places: added on the input path, one weight used twice, a parameter-only branch."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(8))
        self.shared = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos
        x = self.shared(torch.tanh(self.shared(x)))
        return x * self.scale + self.pos.sum() * 0.1


class Counted(torch.autograd.Function):
    """The identity, counting its backward calls: an activation gradient on the input path."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        Counted.calls += 1
        return grad


def _grads(net: nn.Module, split: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    y = net(x)
    g = torch.ones_like(y) * torch.arange(3.0)
    if split:
        weights = inputs_first([y], [g], [x])
        assert weights is not None and x.grad is not None
        assert all(p.grad is None for p in net.parameters())  # the first pass leaves the parameters alone
        weights()
    else:
        torch.autograd.backward([y], [g])
    assert x.grad is not None
    return x.grad, {n: p.grad for n, p in net.named_parameters() if p.grad is not None}


def test_the_two_passes_give_every_gradient_of_the_whole_backward_and_run_the_input_path_once():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), Odd(), nn.LayerNorm(8), nn.Linear(8, 3))
    whole_x, whole = _grads(copy.deepcopy(net), split=False)
    split_x, split = _grads(copy.deepcopy(net), split=True)
    torch.testing.assert_close(split_x, whole_x, atol=1e-6, rtol=0)
    assert set(split) == set(whole) == {n for n, _ in net.named_parameters()}
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=0)

    class Probe(nn.Module):
        def forward(self, x):
            return Counted.apply(x)

    probed = nn.Sequential(nn.Linear(4, 8), Probe(), nn.Tanh(), nn.Linear(8, 3))
    Counted.calls = 0
    _grads(probed, split=True)
    assert Counted.calls == 1  # the weight pass starts below it: activation gradients are not recomputed


def test_a_stage_whose_inputs_need_no_gradient_is_not_split():
    net = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    assert inputs_first([net(x)], [torch.ones(2, 3)], []) is None


def test_split_backward_must_be_a_bool():
    with pytest.raises(TypeError, match="`split_backward` must be True or False, got 'yes'"):
        GPipe(nn.Sequential(nn.Linear(2, 2)), split_backward="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`split_backward` must be True or False"):
        GPipeStrategy(split_backward=1)  # type: ignore[arg-type]


def cases(stages: int) -> list[S.Case]:
    """Chunks 1 and 3 in every checkpoint mode (keep:1 included) on the skip layout, the lopsided balance,
    dropout, and the U-Net (skips across stages), all with the split drain."""
    main, lopsided = (tuple(b) for b in S.BALANCES[stages][:2])
    modes = ["always", "except_last", "never", "keep:1"]
    found = [S.Case(main, c, m, split=True) for c, m in itertools.product([1, 3], modes)]
    found += [S.Case(lopsided, 3, "except_last", split=True), S.Case(main, 3, "never", dropout=0.3, split=True)]
    found += [S.Case(tuple(S.UNET_BALANCES[stages]), 3, m, unet=True, split=True) for m in ("never", "except_last")]
    return found


@pytest.fixture(scope="module")
def runs():
    return {k: run_ok(S.sweep, k, cases(k), timeout=600) for k in (2, 3)}


@pytest.mark.parametrize("stages", [2, 3])
def test_the_split_drain_trains_as_one_device_in_every_mode_with_skips_and_dropout(stages, runs):
    for case in cases(stages):
        whole = (14,) if case.unet else (9,)
        if case.dropout:  # the masks of pipeline-1 with the same chunks
            reference = S.pipeline(S.Case(whole, case.chunks, case.checkpoint, dropout=case.dropout))
        else:
            reference = S.reference(S.Case(whole, case.chunks, case.checkpoint, unet=case.unet))
        _assert_same(runs[stages], case.name, reference)
        # every later stage ran its backwards split (S.STEPS steps, min(chunks, batch) micro-batches); the first none
        passes = [rank[case.name]["split_passes"] for rank in runs[stages]]
        assert passes[0] == 0 and all(p == S.STEPS * case.chunks for p in passes[1:]), passes


class Doubled(nn.Module):
    """A Linear with a tensor hook that doubles its output's gradient, and that output's gradient retained."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.out: torch.Tensor = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.out = y = self.linear(x)
        y.register_hook(lambda g: g * 2)
        y.retain_grad()
        return y


def test_a_gradient_hook_and_retain_grad_on_an_activation_count_once():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Doubled(), nn.Tanh(), nn.Linear(8, 3))
    whole_net, split_net = copy.deepcopy(net), copy.deepcopy(net)
    whole_x, whole = _grads(whole_net, split=False)
    split_x, split = _grads(split_net, split=True)
    torch.testing.assert_close(split_x, whole_x, atol=1e-6, rtol=0)
    assert set(split) == set(whole)
    for name in whole:  # the hooked Linear's weight and bias included: its hooks ran in both passes
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=0)
    retained, expected = split_net[2].out.grad, whole_net[2].out.grad
    assert retained is not None and expected is not None
    torch.testing.assert_close(retained, expected, atol=1e-6, rtol=0)


def test_a_layer_under_reentrant_checkpoint_is_not_split():
    from torch.utils.checkpoint import checkpoint

    net = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = checkpoint(net, torch.tanh(x), use_reentrant=True)
    assert inputs_first([y], [torch.ones(2, 3)], [x]) is None  # else torch.autograd.grad would raise in it
    assert x.grad is None and net.weight.grad is None  # nothing ran: the caller's whole backward does it all


@pytest.fixture(scope="module")
def hooked_and_reentrant():
    return run_ok(W.sweep, 4, timeout=300)


def test_a_hooked_activation_and_a_reentrant_checkpoint_train_as_one_device_with_the_split_drain(
    hooked_and_reentrant,
):
    reference = W.reference()
    for chunks, mode in W.CASES:
        name = f"{chunks}-{mode}"
        _assert_same(hooked_and_reentrant, name, reference)
        passes = [rank[name]["split_passes"] for rank in hooked_and_reentrant]
        # the first stage never splits, the hooked stage and the last always, the reentrant-checkpoint one never
        assert passes == [0, W.STEPS * chunks, 0, W.STEPS * chunks], (name, passes)


def test_data_parallel_replicas_of_a_pipeline_with_the_split_drain_train_as_one_device(hooked_and_reentrant):
    reference = W.replicas_reference()
    for rank, results in enumerate(hooked_and_reentrant):
        got = results["replicas"]
        assert got["weights"] and set(got["weights"]) <= set(reference), f"rank {rank}"
        for key, value in got["weights"].items():
            torch.testing.assert_close(
                value, reference[key], atol=1e-6, rtol=0, msg=lambda m: f"rank {rank} {key}: {m}"
            )
        # stage 0 (ranks 0 and 2) is first and runs whole; stage 1 splits every micro-batch of every step
        assert got["split_passes"] == (0 if rank % 2 == 0 else W.STEPS * 3), (rank, got["split_passes"])


class Branches(nn.Module):
    """Two parallel Linears on one input (an AmoebaNet cell in miniature), summed."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + torch.tanh(self.right(x))


def test_parallel_branches_share_one_weight_pass_call_without_recomputing_activation_gradients(monkeypatch):
    class Probe(nn.Module):
        def forward(self, x):
            return Counted.apply(x)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), Probe(), Branches(), nn.Linear(8, 3))
    whole_x, whole = _grads(copy.deepcopy(net), split=False)
    calls = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: calls.append(1) or backward(*a, **k))
    Counted.calls = 0
    split_x, split = _grads(copy.deepcopy(net), split=True)
    assert Counted.calls == 1  # below both branches: its gradient is computed once, in the first pass
    # the last Linear, then both branches together, then the first Linear: three calls for four layers
    assert len(calls) == 3
    torch.testing.assert_close(split_x, whole_x, atol=1e-6, rtol=0)
    assert set(split) == set(whole)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=0)
