"""In-place layers on a stage's input: they work as on one device, and a recompute starts from the input as it came.

In one process (K=1) the stage's input is the pipeline's own, so these run without spawning; the
multi-process runs (every stage starting with an in-place layer, K = 2, 3, 4) are in ``test_fidelity.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe import GPipe
from lightning_gpipe.balancing.profiling import profile_layers

MODES = ["never", "always", "except_last", "keep:1"]


def _inplace_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.LeakyReLU(0.1, inplace=True),  # first: it writes the stage's input (not idempotent: twice would show)
        nn.Linear(6, 8),
        nn.ReLU(inplace=True),
        nn.Linear(8, 3),
    )


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    out = model(x)
    (out * torch.arange(1.0, 4.0)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()], x.grad


@pytest.mark.parametrize("input_needs_grad", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_first_layer_trains_as_the_plain_sequential_in_every_checkpoint_mode(mode, input_needs_grad):
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    x_plain = data.clone().requires_grad_(input_needs_grad)
    x_pipe = data.clone().requires_grad_(input_needs_grad)
    # the plain Sequential gets a non-leaf when the input needs grad (as behind a stem): torch refuses in-place
    # ops on a leaf that requires grad, on one device too
    out, grads, input_grad = _grads(_inplace_net(), x_plain * 1.0 if input_needs_grad else x_plain)
    if input_needs_grad:
        input_grad = x_plain.grad
    got_out, got_grads, got_input_grad = _grads(GPipe(_inplace_net(), chunks=4, checkpoint=mode), x_pipe)
    # micro-batches add their gradients in another order than the whole batch: float32 rounding, relative to size
    torch.testing.assert_close(got_out, out, atol=1e-6, rtol=1e-6)
    for got, want in zip(got_grads, grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if input_needs_grad:
        torch.testing.assert_close(got_input_grad, input_grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["always", "except_last", "keep:1"])
def test_an_in_place_dropout_first_is_recomputed_from_the_unwritten_input(mode):
    # The masks are keyed by (seed, call, micro-batch, layer), so every mode draws the same ones; a recompute
    # from the input the forward wrote would apply the dropout twice (scaled twice, more zeros).
    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Dropout(0.5, inplace=True), nn.Linear(6, 3))

    data = torch.randn(8, 6)
    never = GPipe(net(), chunks=4, checkpoint="never", seed=3)
    recomputed = GPipe(net(), chunks=4, checkpoint=mode, seed=3)
    out_never, grads_never, _ = _grads(never, data.clone())
    out, grads, _ = _grads(recomputed, data.clone())
    assert torch.equal(out, out_never)
    for got, want in zip(grads, grads_never):
        assert torch.equal(got, want)


def test_a_stage_that_writes_its_input_only_later_stops_naming_the_write_and_the_fixes():
    class SometimesInPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x.mul_(2.0) if self.calls > 2 else x * 2.0  # out of place in the first call's two micro-batches

    # it counts its calls, so without the per-sample check's 3 calls in the first
    layers = nn.Sequential(SometimesInPlace(), nn.Linear(6, 3))
    pipe = GPipe(layers, chunks=2, checkpoint="always", check_per_sample=False)
    pipe(torch.randn(4, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="Stage 0's layers wrote their input in place") as error:
        pipe(torch.randn(4, 6))
    assert "checkpointed micro-batch 0" in str(error.value) and "checkpoint='never'" in str(error.value)


def test_profiling_measures_in_place_layers_and_leaves_the_sample_unwritten():
    sample = torch.randn(4, 6)
    before = sample.clone()
    costs = profile_layers(_inplace_net(), sample, repeats=2)
    assert len(costs.time) == 4 and all(t > 0 for t in costs.time)
    assert torch.equal(sample, before)


def test_a_write_to_the_first_stages_input_fails_a_stem_that_saved_it_as_on_one_device():
    # Sigmoid saves its output for its backward; the backbone's in-place first layer then writes it. One device
    # refuses that backward; so must the pipeline, whose micro-batch leaves alias the stem's output.
    def stem_and_backbone() -> tuple[nn.Module, nn.Sequential]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Sigmoid()), _inplace_net()

    stem, backbone = stem_and_backbone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        backbone(stem(torch.randn(8, 6))).sum().backward()
    stem, backbone = stem_and_backbone()
    pipe = GPipe(backbone, chunks=4, checkpoint="never")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pipe(stem(torch.randn(8, 6))).sum().backward()


def test_a_batch_of_a_tensor_subclass_still_trains_through_the_pipeline():
    # the first stage aliases plain tensors' memory; a subclass (as some libraries' batches are) keeps detach()
    class Tagged(torch.Tensor):
        pass

    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    pipe = GPipe(_inplace_net(), chunks=4, checkpoint="except_last")
    plain = _inplace_net()
    got_out, got_grads, _ = _grads(pipe, data.clone().as_subclass(Tagged))
    out, grads, _ = _grads(plain, data.clone())
    torch.testing.assert_close(got_out.as_subclass(torch.Tensor), out, atol=1e-6, rtol=1e-6)
    for got, want in zip(got_grads, grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
