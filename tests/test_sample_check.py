"""Layers that mix the samples along dim 0 are refused at the first call that cuts a batch (engine/sample_check.py).

Cutting a batch into micro-batches equals the whole batch only where each layer works per sample; the common way
to break that is a sequence-first layer given ``(sequence, batch, ...)``, where the cut falls across the sequence.
"""

from __future__ import annotations

import _trust_workers as W
import pytest
import torch
from torch import nn

from lightning_gpipe import GPipe, skippable, stash
from lightning_gpipe.engine.sample_check import MixedSamples, find_mixing, mismatch, probing, replaced
from lightning_gpipe.launch import run_processes


class Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(0, 1)


class Output(nn.Module):
    """An LSTM's output without its state."""

    def forward(self, pair):
        return pair[0]


class Centre(nn.Module):
    """Subtracts the batch's mean: mixes the samples on purpose."""

    def forward(self, x):
        return x - x.mean(0)


class Counter(nn.Module):
    """Counts its forwards in a buffer and in an attribute, and scales by the buffer: a forward that writes state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.calls = 0

    def forward(self, x):
        self.count += 1
        self.calls += 1
        return x * (1 + self.count / 10)


def _sequence_first(batch_first_input: bool) -> nn.Sequential:
    """Sequence-first attention and LSTM; with ``batch_first_input`` the model transposes around them itself."""
    torch.manual_seed(0)
    inner = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1), nn.LSTM(16, 16), Output()]
    around = [Transpose(), *inner, Transpose()] if batch_first_input else inner
    return nn.Sequential(nn.Linear(8, 16), *around, nn.Linear(16, 4))


def test_a_sequence_first_transformer_given_sequence_first_input_is_refused_naming_the_layer_in_training_and_eval():
    x = torch.randn(6, 4, 8)  # (sequence, batch, features): the cut into micro-batches falls across the sequence
    message = r"Stage 0 mixes the samples along dim 0, first in layer 1 \(TransformerEncoderLayer\): its output for"
    with pytest.raises(MixedSamples, match=message) as refused:
        GPipe(_sequence_first(False), chunks=2)(x)
    assert "batch_first=True" in str(refused.value) and "check_per_sample=False" in str(refused.value)
    with torch.no_grad(), pytest.raises(MixedSamples, match=message):
        GPipe(_sequence_first(False), chunks=2)(x)


def test_sequence_first_layers_that_get_the_batch_in_dim_1_pass_and_the_pipeline_equals_the_sequential():
    # the same layers, transposed around inside the model: per sample, as the pipeline needs
    x = torch.randn(6, 5, 8)  # (batch, sequence, features)
    sequential = _sequence_first(True).eval()
    pipe = GPipe(_sequence_first(True), chunks=3).eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), sequential(x), atol=1e-6, rtol=0)
    assert pipe.runner.per_sample_checked


def test_a_layer_that_mixes_samples_on_purpose_runs_per_micro_batch_with_check_per_sample_false():
    x = torch.randn(8, 4)
    with pytest.raises(MixedSamples, match=r"Stage 0 mixes the samples along dim 0, first in layer 1 \(Centre\)"):
        GPipe(nn.Sequential(nn.Linear(4, 4), Centre()), chunks=2)(x)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), Centre())
    out = GPipe(layers, chunks=2, check_per_sample=False)(x)
    expected = torch.cat([layers(x[:4]), layers(x[4:])])  # each micro-batch centred on its own mean
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    with pytest.raises(TypeError, match="`check_per_sample` must be True or False, got 'no'"):
        GPipe(layers, check_per_sample="no")


def test_nothing_is_checked_where_nothing_is_cut_or_the_batch_has_one_sample():
    x = torch.randn(6, 4, 8)
    sequential = _sequence_first(False).eval()
    whole = GPipe(_sequence_first(False), chunks=1).eval()
    with torch.no_grad():  # chunks=1: the batch is never cut, so a sequence-first layout is right
        torch.testing.assert_close(whole(x), sequential(x), atol=1e-6, rtol=0)
    assert not whole.runner.per_sample_checked
    pipe = GPipe(_sequence_first(False), chunks=2)
    pipe(x[:1])  # one sample: nothing to compare it with
    assert not pipe.runner.per_sample_checked
    with pytest.raises(MixedSamples, match="TransformerEncoderLayer"):
        pipe(x)


def test_the_check_leaves_no_trace_in_outputs_gradients_buffers_random_streams_or_training_modes():
    def run(check: bool):
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), Counter(), nn.BatchNorm1d(8), nn.Linear(8, 2))
        pipe = GPipe(layers, chunks=2, checkpoint="except_last", seed=3, check_per_sample=check)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        outs = [pipe(x) for _ in range(2)]
        sum(o.square().sum() for o in outs).backward()
        return pipe, outs, layers

    checked, checked_outs, checked_layers = run(True)
    plain, plain_outs, plain_layers = run(False)
    assert checked.runner.per_sample_checked and not plain.runner.per_sample_checked
    for a, b in zip(checked_outs, plain_outs):
        assert torch.equal(a, b)
    for (name, a), b in zip(checked_layers.named_parameters(), plain_layers.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(checked_layers.named_buffers(), plain_layers.buffers()):
        assert torch.equal(a, b), name  # the counter and BatchNorm's statistics count the training calls only
    assert all(m.training for m in checked_layers.modules())
    # nor does its plain Python attribute: the check's 3 calls (the micro-batch whole and its halves) are put back
    assert checked_layers[2].calls == plain_layers[2].calls == 4


def test_each_half_is_replaced_by_the_other_and_the_mismatch_is_the_kept_rows_relative_norm():
    x = (torch.arange(5.0).unsqueeze(1), torch.tensor(9.0), {"ids": torch.arange(5)})
    first, scalar, ids = replaced(x, 5, keep_first=True)
    assert first.flatten().tolist() == [0, 1, 0, 1, 0] and ids["ids"].tolist() == [0, 1, 0, 1, 0] and scalar == 9
    assert replaced(x, 5, keep_first=False)[0].flatten().tolist() == [2, 3, 2, 3, 4]
    reference = (torch.tensor([[3.0], [4.0], [1.0]]), torch.tensor([1, 2, 3]), torch.tensor(5.0))
    other = (torch.tensor([[3.0], [9.0], [1.0]]), torch.tensor([0, 0, 0]), torch.tensor(1.0))
    assert mismatch(reference, other, 3, keep_first=True)[0] == 0.0  # row 0 kept; ints and 0-dim not compared
    difference, tolerance = mismatch(reference, other, 3, keep_first=False)
    assert difference == pytest.approx(5 / 17**0.5) and tolerance == 1e-3  # rows 1-2: |(5, 0)| / |(4, 1)|
    half = torch.ones(2, 3, dtype=torch.bfloat16)
    assert mismatch(half, half * 2, 2, keep_first=True) == (1.0, 1e-2)
    assert mismatch((torch.ones(2),), torch.ones(2), 2, keep_first=True) == (0.0, 1.0)  # other forms: nothing compared
    spectrum = torch.tensor([[1 + 1j], [2 + 0j]], dtype=torch.complex64)  # complex: its real and imaginary parts
    moved = torch.tensor([[1 + 1j], [2 + 2j]], dtype=torch.complex64)
    assert mismatch(spectrum, moved, 2, keep_first=True)[0] == 0.0
    assert mismatch(spectrum, moved, 2, keep_first=False) == (pytest.approx(1.0), 1e-3)  # |(0, 2)| / |(2, 0)|


class Noise(nn.Module):
    """Adds noise in training and evaluation alike: random, yet per sample."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


def test_a_causal_sequence_first_lstm_is_refused_and_a_transpose_inside_or_random_noise_is_not():
    # an LSTM over (sequence, batch, ...) is causal along dim 0: the first positions do not depend on the later ones,
    # so the check also replaces the first half; the model that transposes around it has sequence length = the
    # micro-batch (4), so dim 0 of the transposed tensor looks per sample, and it must still pass
    torch.manual_seed(0)
    lstm = nn.Sequential(nn.Linear(8, 16), nn.LSTM(16, 16), Output())
    with pytest.raises(MixedSamples, match=r"first in layer 1 \(LSTM\)"):
        GPipe(lstm, chunks=2)(torch.randn(8, 3, 8))
    inside = nn.Sequential(nn.Linear(8, 16), Transpose(), nn.LSTM(16, 16), Output(), Transpose(), Noise())
    pipe = GPipe(inside, chunks=2)
    pipe(torch.randn(8, 4, 8)).sum().backward()
    assert pipe.runner.per_sample_checked


def test_per_sample_models_pass_under_bfloat16_autocast_and_probing_restores_modes_and_buffers():
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64)) for _ in range(8)])
    indexed = list(enumerate(layers))
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), probing(layers):
        assert find_mixing(indexed, x, {}, 16, lambda index: None).mixing is None
    norm = nn.BatchNorm1d(4)
    before = norm.running_mean
    with probing(norm):
        assert not norm.training
        norm(torch.randn(6, 4) + 3)
    assert norm.training and norm.running_mean is before and not before.any()


def test_a_sequence_first_layer_on_stage_1_ends_every_rank_naming_the_layer_and_the_fix_through_the_trainer():
    outcome = run_processes(W.sequence_first_fit, 2, True, timeout=120)
    assert all(code not in (0, None) for code in outcome.exitcodes), outcome.exitcodes
    assert outcome.seconds < 60 and all(outcome.errors), outcome.errors
    refusal = "MixedSamples: Stage 1 mixes the samples along dim 0, first in layer 2 (TransformerEncoderLayer)"
    assert outcome.errors[1].startswith(refusal), outcome.errors[1]
    assert f"stage 1 (rank 1) failed: {refusal}" in outcome.errors[0], outcome.errors[0]
    assert run_processes(W.sequence_first_fit, 2, False, timeout=120).exitcodes == [0, 0]  # check_per_sample=False


def test_micro_batches_of_one_sample_are_checked_on_the_first_two_joined_shapes_included():
    # chunks = the batch size: nothing to replace within a micro-batch, and an LSTM's h of shape (1, 1, H) looks like
    # one sample; joined into 2 samples, it shows (1, 2, H): not the batch in dim 0
    x = torch.randn(4, 3, 8)
    with pytest.raises(MixedSamples, match=r"first in layer 1 \(TransformerEncoderLayer\)"):
        GPipe(_sequence_first(False), chunks=4)(x.transpose(0, 1))  # 3 positions: micro-batches of one position
    torch.manual_seed(0)
    raw = nn.Sequential(nn.Linear(8, 16), nn.LSTM(16, 16, batch_first=True))  # the backbone's output: (out, (h, c))
    message = r"returned a tensor of shape \(1, 2, 16\) for a micro-batch of 2 samples \(checked on 2 samples joined"
    with pytest.raises(ValueError, match=message):
        GPipe(raw, chunks=4)(x)
    sequential = _sequence_first(True).eval()
    pipe = GPipe(_sequence_first(True), chunks=4).eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), sequential(x), atol=1e-6, rtol=0)
    assert pipe.runner.per_sample_checked


@skippable(stash=["t"])
class StashTransposed(nn.Module):
    """Stashes its input with the batch in dim 1, as a sequence-first skip would."""

    def forward(self, x):
        stash("t", x.t())
        return x


def test_a_skip_sent_without_the_batch_in_dim_0_is_named_as_the_skip_not_as_the_stages_last_layer():
    # a square micro-batch (4 samples of 4 features): the transposed skip's shape cannot show where the batch is.
    # before: "Stage 0 mixes the samples along dim 0, first in layer 2 (Linear)", the last layer, with the
    # sequence-first advice, though every layer keeps the samples apart
    layers = [(0, nn.Linear(4, 4)), (1, StashTransposed()), (2, nn.Linear(4, 4))]
    with probing(nn.ModuleList([layer for _, layer in layers])):
        probe = find_mixing(
            layers, torch.randn(4, 4), {}, 4, lambda index: None, lambda tracker: {1: list(tracker.stashed.values())}
        )
    assert probe.mixing is not None and probe.mixing.skip_to == 1
    message = str(MixedSamples.at(0, probe.mixing, 4))
    assert message.startswith("Stage 0 sends stage 1 a skip whose rows for some samples of a micro-batch of 4 changed")
    assert "Stash the tensor with the batch in dim 0 and transpose it after `pop`" in message
    with probing(nn.ModuleList([layer for _, layer in layers])):  # the same skip kept per sample passes
        kept = find_mixing(layers[:1] + layers[2:], torch.randn(4, 4), {}, 4, lambda index: None)
    assert kept.mixing is None
