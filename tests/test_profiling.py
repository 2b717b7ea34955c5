"""Layer profiling: what it counts, that it measures time, that it leaves the model as it was, clear errors."""

from __future__ import annotations

import collections
import time
import types

import pytest
import torch
from torch import nn

from lightning_gpipe import balance
from lightning_gpipe.balancing.profiling import LayerCosts, crossable_at, profile_layers, state_bytes
from lightning_gpipe.balancing.sample import capture_input, sample_micro_batch


class Sleep(nn.Module):
    """A parameter-free layer whose forward takes a known time."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x * 1.0


class Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("broken layer")


def test_memory_counts_weights_gradients_optimizer_state_and_saved_activations():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5), nn.BatchNorm1d(5))
    costs = profile_layers(model, torch.randn(4, 10), repeats=1)
    assert costs.params == [220, 0, 105, 10]
    # float32 weights + their gradient + 2 Adam states, and BatchNorm's buffers (2 x 5 floats + 1 int64)
    assert costs.state_bytes == [220 * 4 * 4, 0, 105 * 4 * 4, 10 * 4 * 4 + 2 * 5 * 4 + 8]
    # Linear saves its input (4x10); ReLU its output (4x20), which the next Linear saves again and is not
    # counted twice; BatchNorm its input (4x5) and the batch mean and inverse std (5 each)
    assert costs.activation_bytes == [4 * 10 * 4, 4 * 20 * 4, 0, (4 * 5 + 5 + 5) * 4]
    assert costs.memory == [float(s + a) for s, a in zip(costs.state_bytes, costs.activation_bytes)]


def test_activation_bytes_scale_with_the_micro_batch_and_frozen_layers_have_no_gradient_or_state():
    frozen = nn.Linear(8, 8).requires_grad_(False)
    small = profile_layers(nn.Sequential(nn.Tanh(), frozen), torch.randn(2, 8, requires_grad=True), repeats=1)
    large = profile_layers(nn.Sequential(nn.Tanh(), frozen), torch.randn(6, 8, requires_grad=True), repeats=1)
    assert large.activation_bytes[0] == 3 * small.activation_bytes[0] > 0
    assert small.state_bytes[1] == 72 * 4  # the weights only
    assert state_bytes(nn.Linear(8, 8), optimizer_states=0) == 72 * 4 * 2  # plain SGD: weights and gradients


def test_time_is_measured_per_layer_and_balance_time_splits_by_it():
    model = nn.Sequential(Sleep(0.02), Sleep(0.02), nn.Linear(4, 4), nn.Linear(4, 4))
    costs = profile_layers(model, torch.randn(3, 4), repeats=3)
    assert min(costs.time[:2]) > 0.018 and max(costs.time[2:]) < 0.01
    assert balance(costs.of("time"), 2) == [1, 3]  # one sleeping layer in each stage
    assert balance(costs.of("params"), 2) == [3, 1]  # one Linear in each stage


def test_profiling_leaves_buffers_gradients_modes_and_random_state_as_they_were():
    model = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.Dropout(0.5), nn.Linear(5, 2))
    model[3].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 5)
    rng = torch.get_rng_state()
    profile_layers(model, sample, repeats=2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model] == [True, True, True, False]
    assert torch.equal(torch.get_rng_state(), rng)


def test_layers_are_moved_to_the_device_one_at_a_time_and_back(monkeypatch):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    moves = []
    original = nn.Module.to

    def spy(self, *args, **kwargs):
        if any(self is layer for layer in model):
            moves.append((next(i for i, layer in enumerate(model) if layer is self), str(args[0])))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", spy)
    profile_layers(model, torch.randn(2, 3), device="cpu", repeats=1)
    # a layer goes to the profiling device and back to where it lives before the next one moves (the
    # parameter-free ReLU has no home device to go back to); one sweep to count, one timed sweep
    assert moves == [(0, "cpu"), (0, "cpu"), (1, "cpu"), (2, "cpu"), (2, "cpu")] * 2


def test_a_layer_that_fails_is_named_by_index_and_type():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), Boom(), nn.Linear(3, 3))
    with pytest.raises(
        RuntimeError,
        match=r"Profiling layer 2 \(Boom\) of the backbone on a micro-batch of 2 samples failed with RuntimeError: "
        r"broken layer.*a reshape to a fixed batch size.*`balance`",
    ):
        profile_layers(model, torch.randn(2, 3))


def test_a_batch_norm_profiled_on_one_sample_is_told_to_use_fewer_chunks_not_an_explicit_balance():
    # chunks equal to the batch size: the advice was "give the split explicitly with `balance`", which only moved the
    # same error to the first step
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    with pytest.raises(RuntimeError, match=r"Profiling layer 1 \(BatchNorm1d\) .* of 1 sample failed") as refused:
        profile_layers(model, torch.randn(1, 3))
    assert "at least 2 x chunks samples" in str(refused.value) and "fewer chunks" in str(refused.value)
    assert "`balance`" not in str(refused.value)


def test_a_last_layer_whose_output_cannot_leave_the_pipeline_is_named_too():
    class Namespace(nn.Module):
        def forward(self, x):
            return types.SimpleNamespace(x=x)

    with pytest.raises(
        RuntimeError, match=r"layer 1 \(Namespace\).*got a SimpleNamespace; a stage must return Tensors"
    ):
        profile_layers(nn.Sequential(nn.ReLU(), Namespace()), torch.randn(2, 3))


def test_tuple_outputs_flow_to_the_next_layer():
    class Split(nn.Module):
        def forward(self, x):
            return x[:, :2], x[:, 2:]

    class Join(nn.Module):
        def forward(self, pair):
            return torch.cat(pair, dim=1)

    costs = profile_layers(
        nn.Sequential(nn.Linear(4, 4), Split(), Join(), nn.Linear(4, 1)), torch.randn(3, 4), repeats=1
    )
    assert len(costs.time) == 4 and costs.params == [20, 0, 0, 5]


def test_outputs_that_cannot_leave_a_stage_are_profiled_and_marked_so_an_automatic_split_keeps_the_next_layer():
    # an LSTM's (output, (h, c)) (h and c sequence first), a sequence-first tensor and a namedtuple made in a
    # function (no other process can unpickle it) run on one stage but cannot cross to another; the profile says
    # which layers' outputs cannot, instead of failing the whole default split. Batch-first structures can.
    class First(nn.Module):
        def forward(self, pair):
            out, (h, _) = pair
            return out + h[-1].unsqueeze(1)

    class SequenceFirst(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1)

    Pair = collections.namedtuple("Pair", "a b")

    class Named(nn.Module):
        def forward(self, x):
            return Pair(x, x)

    class Add(nn.Module):
        def forward(self, pair):
            return pair.a + pair.b

    class Nested(nn.Module):
        def forward(self, x):
            return {"x": x, "pair": (x, None)}

    class Sum(nn.Module):
        def forward(self, d):
            return d["x"] + d["pair"][0]

    module = nn.Sequential(
        nn.Linear(2, 4), nn.LSTM(4, 4, batch_first=True), First(), SequenceFirst(), SequenceFirst(), Named(), Add(),
        Nested(), Sum(),
    )  # fmt: skip
    costs = profile_layers(module, torch.randn(3, 5, 2), repeats=1)
    assert costs.crossable == (True, False, True, False, True, False, True, True, True)
    assert costs.output_bytes[1] == 4 * (3 * 5 * 4 + 2 * 3 * 4)  # every tensor of the nested output counted
    assert costs.time[1] > 0


def test_what_may_leave_a_stage_is_decided_on_two_samples_where_one_cannot_show_it():
    # an LSTM's (output, (h, c)): h is (1, 1, 4) for one sample, which looks per sample, and (1, 2, 4) for two
    module = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(5), nn.LSTM(4, 4, batch_first=True), nn.Identity())
    before = module[1].running_mean.clone()
    assert crossable_at(module, torch.randn(1, 5, 2)) == (True, True, True, True)
    assert crossable_at(module, torch.randn(2, 5, 2)) == (True, True, False, False)
    assert torch.equal(module[1].running_mean, before) and all(m.training for m in module.modules())


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Sequential"):
        profile_layers(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(ValueError, match="`repeats` must be a positive integer"):
        profile_layers(nn.Sequential(nn.ReLU()), torch.randn(1, 2), repeats=0)
    with pytest.raises(ValueError, match="Unknown cost 'speed'"):
        LayerCosts([1], [1.0], [1], [1]).of("speed")


def test_sample_micro_batch_is_the_first_micro_batch_with_its_own_memory():
    batch = (torch.arange(10.0).view(10, 1), {"mask": torch.ones(10, 2)})
    x, extra = sample_micro_batch(batch, 4)
    assert x.flatten().tolist() == [0.0, 1.0, 2.0] and extra["mask"].shape == (3, 2)
    assert x.untyped_storage().nbytes() == 3 * 4
    assert sample_micro_batch(torch.zeros(2, 3), 4).shape == (1, 3)  # a small batch gives a small micro-batch


def test_capture_input_stops_at_the_backbone_and_restores_the_stem():
    stem = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    backbone = nn.Sequential(Boom())  # would raise if it ran
    owner = nn.ModuleDict({"stem": stem, "backbone": backbone})
    before = stem[1].running_mean.clone()
    after_backbone = []

    def step():
        try:
            y = backbone(stem(torch.randn(6, 4)))
        except Exception:  # a user's broad except does not swallow the capture
            after_backbone.append("swallowed")
            raise
        after_backbone.append(y)

    x = capture_input(backbone, step, owner=owner)
    assert x.shape == (6, 4) and x.requires_grad and x.grad_fn is None
    assert after_backbone == []
    assert torch.equal(stem[1].running_mean, before)
    with pytest.raises(LookupError, match="without calling the backbone"):
        capture_input(backbone, lambda: stem(torch.randn(2, 4)))


def test_capture_input_leaves_the_steps_plain_attributes_and_records_as_they_were():
    # the profile runs training_step on rank 0 alone, up to the backbone call: before, a counter and a record written
    # there counted the profile's run (rank 0 saw the first batch twice: [[0..3], [0..3], [4..7], ...])

    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(Boom())
            self.calls, self.seen, self.by_size, self.sizes = 0, [], {}, set()

        def training_step(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            self.seen.append(len(x))
            self.by_size[len(x)] = self.by_size.get(len(x), 0) + 1
            self.sizes.add(len(x))
            self.made_here = True
            return self.backbone(x)

    module = Step()
    seen = module.seen  # another holder of the same list
    capture_input(module.backbone, lambda: module.training_step(torch.randn(5, 2)), owner=module)
    assert (module.calls, module.seen, module.by_size, module.sizes) == (0, [], {}, set())
    assert module.seen is seen and not hasattr(module, "made_here")


def test_capture_input_leaves_metrics_as_they_were_and_logs_nothing():
    import torchmetrics

    class Step(nn.Module):
        """A LightningModule's shape: a metric updated and a value logged before the backbone is called."""

        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(Boom())
            self.seen = torchmetrics.SumMetric()
            self.labels = torchmetrics.CatMetric()
            self.logged: list[str] = []

        def log(self, name: str, value: object) -> None:
            self.logged.append(name)

        def training_step(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.update(torch.tensor(float(len(x))))
            self.labels.update(x[:, 0])
            self.log("seen", self.seen)
            return self.backbone(x)

    module = Step()
    module.seen.update(torch.tensor(2.0))  # a batch seen before
    x = capture_input(module.backbone, lambda: module.training_step(torch.randn(5, 2)), owner=module)
    assert x.shape == (5, 2)
    assert module.seen.compute().item() == 2.0 and module.seen._update_count == 1  # as before the capture
    assert module.labels._update_count == 0
    assert module.logged == [] and "log" not in vars(module)  # silenced, and the method is back
    module.log("after", 1)
    assert module.logged == ["after"]
