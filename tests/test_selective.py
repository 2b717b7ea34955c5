"""``torch.autograd.grad`` and ``backward(inputs=...)`` through the pipeline give what they give on one device,
and leave every ``.grad`` alone (``lightning_gpipe.engine.selective``); in one process, K=1."""

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
def test_autograd_grad_of_the_parameters_and_the_input_equals_one_device_and_fills_no_grad(checkpoint):
    sequential, pipe = _pair(checkpoint)
    x = torch.randn(5, 4, requires_grad=True)
    want = torch.autograd.grad(sequential(x).pow(2).sum(), [x, *sequential.parameters()])
    got = torch.autograd.grad(pipe(x).pow(2).sum(), [x, *pipe.parameters()])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    assert all(p.grad is None for p in pipe.parameters()) and x.grad is None


def test_an_input_gradient_alone_fills_no_parameters_grad():
    # a saliency map: the drain used to add this call's parameter gradients to .grad on the side
    _, pipe = _pair("except_last")
    x = torch.randn(5, 4, requires_grad=True)
    (saliency,) = torch.autograd.grad(pipe(x).sum(), x)
    assert saliency.shape == x.shape and saliency.abs().sum() > 0
    assert all(p.grad is None for p in pipe.parameters())


def test_backward_with_inputs_fills_only_the_named_grads_as_on_one_device():
    sequential, pipe = _pair("except_last")
    x = torch.randn(5, 4)
    sequential(x).sum().backward(inputs=[sequential[0].weight])
    pipe(x).sum().backward(inputs=[pipe.get_parameter("0.weight")])
    for (name, p), q in zip(sequential.named_parameters(), pipe.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=0)
    assert sequential[0].weight.grad is not None and sequential[2].weight.grad is None
