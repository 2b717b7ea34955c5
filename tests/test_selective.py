"""``torch.autograd.grad`` and ``backward(inputs=...)`` through the pipeline give the input gradients one device
gives and leave every ``.grad`` alone (``lightning_gpipe.engine.selective``); in one process, K=1."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_gpipe import GPipe


def _pair(checkpoint: str) -> tuple[nn.Sequential, GPipe]:
    torch.manual_seed(0)
    sequential = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    return sequential, GPipe(copy.deepcopy(sequential), chunks=3, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_autograd_grad_of_the_input_equals_one_device_and_fills_no_parameters_grad(checkpoint):
    # a saliency map or an adversarial example: the drain added this call's parameter gradients to .grad on the side
    sequential, pipe = _pair(checkpoint)
    x = torch.randn(5, 4, requires_grad=True)
    (want,) = torch.autograd.grad(sequential(x).pow(2).sum(), x)
    (got,) = torch.autograd.grad(pipe(x).pow(2).sum(), x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert all(p.grad is None for p in pipe.parameters()) and x.grad is None


def test_backward_with_inputs_fills_only_the_named_grad_as_on_one_device():
    sequential, pipe = _pair("except_last")
    x = torch.randn(5, 4)
    stem = nn.Linear(4, 4)
    stem_copy = copy.deepcopy(stem)
    sequential(stem(x)).sum().backward(inputs=[stem.weight])
    pipe(stem_copy(x)).sum().backward(inputs=[stem_copy.weight])
    torch.testing.assert_close(stem_copy.weight.grad, stem.weight.grad, atol=1e-6, rtol=0)
    assert stem_copy.bias.grad is None and all(p.grad is None for p in pipe.parameters())


def test_autograd_grad_naming_the_stages_parameters_is_torchs_not_used_in_the_graph():
    # the known limit: the stage's parameters are not inputs of the pipeline's autograd node (their hooks would run
    # with None on every whole backward), so a call cannot ask for them through it
    _, pipe = _pair("never")
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(pipe(torch.randn(5, 4)).sum(), list(pipe.parameters()))
