"""Features the pipeline cannot give the one-device result for, refused before the first step with the fix."""

from __future__ import annotations

import _models as M
import _refusal_workers as W
import lightning as L
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_gpipe import GPipeStrategy, refusals
from lightning_gpipe.launch import run_processes


def _fit(model: L.LightningModule) -> None:
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=1, **M.trainer_kwargs(max_steps=1))
    trainer.fit(model, M.loader())


def test_compiling_the_backbone_in_place_is_refused_and_names_compiling_the_layers():
    model = M.Net()
    model.backbone.compile(backend="eager")
    with pytest.raises(
        ValueError, match=r"`Net.backbone`.compile\(\) compiles the Sequential's call.*layer.compile\(\)"
    ):
        _fit(model)


def test_torch_compile_of_the_sequential_is_refused_and_names_compiling_the_layers():
    model = M.Net()
    model.backbone = torch.compile(model.backbone, backend="eager")
    with pytest.raises(TypeError, match=r"is `torch.compile\(nn.Sequential\(...\)\)`.*layer.compile\(\)"):
        _fit(model)


def test_a_compiled_lightning_module_is_refused_by_lightning_naming_the_strategy():
    # Lightning re-applies torch.compile after the strategy's setup for the strategies it lists; the pipeline
    # replaced the backbone by then, so it must not be on that list (compile the layers instead)
    with pytest.raises(
        RuntimeError, match=r"compiled model is incompatible with the current strategy: `GPipeStrategy`"
    ):
        _fit(torch.compile(M.Net(), backend="eager"))


class _Residual(torch.nn.Sequential):
    """A Sequential whose own forward adds a residual around each layer: not the chain the pipeline runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = x + layer(x)
        return x


def test_a_sequential_subclass_with_its_own_forward_is_refused_naming_the_class_and_the_fix():
    # it trained as a plain chain of its layers: 1.05 off one device in the weights after 8 steps, silently
    model = M.Net()
    model.backbone = _Residual(*model.backbone)
    refused = r"`Net.backbone` is a _Residual, a subclass of nn.Sequential with its own forward .*plain nn.Sequential"
    with pytest.raises(TypeError, match=refused):
        _fit(model)
    with pytest.raises(TypeError, match=r"The module given to GPipe is a _Residual"):
        from lightning_gpipe import GPipe

        GPipe(_Residual(torch.nn.Linear(3, 3)))
    GPipe(_Unchanged(torch.nn.Linear(3, 3)))  # a subclass that keeps nn.Sequential's forward runs


class _Unchanged(torch.nn.Sequential):
    """A Sequential subclass that adds nothing to the call."""


def test_a_distributed_sampler_over_the_jobs_processes_is_refused_naming_the_replicas_to_shard_over():
    # a DDP script's `DistributedSampler(dataset)` shards over every process, stages included: the batch check stopped
    # the first batch, with a list of usual causes that did not name the sampler
    data = torch.utils.data.TensorDataset(torch.zeros(8, 2))
    replicas = {"num_replicas": 1, "rank": 0}  # two stages, one replica
    refused = r"DistributedSampler over num_replicas=2, rank=\d.*distributed_sampler_kwargs"
    for rank in (0, 1):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank)
        batches = BatchSampler(sampler, batch_size=2, drop_last=False)
        for loader in (DataLoader(data, sampler=sampler), DataLoader(data, batch_sampler=batches)):
            with pytest.raises(ValueError, match=refused):
                refusals.stage_sharded_sampler(loader, replicas, 2)
    two = {"num_replicas": 2, "rank": 1}  # 2 replicas of 2 stages: the replica's own sampler passes
    refusals.stage_sharded_sampler(DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1)), two, 4)
    refusals.stage_sharded_sampler(DataLoader(data, shuffle=True), replicas, 2)


def test_lazy_layers_are_refused_naming_the_layer_and_a_sample_forward_before_fit():
    # a lazy layer failed inside the profile with torch's own error (K=2: on every rank); DDP refuses them too
    model = M.Net()
    model.backbone[2] = torch.nn.LazyLinear(24)
    refused = r"Layer 2 \(LazyLinear\) of the backbone has uninitialized parameters.*forward"
    with pytest.raises(ValueError, match=refused):
        _fit(model)
    with pytest.raises(ValueError, match=r"Layer 0 \(LazyLinear\) of the backbone has uninitialized parameters"):
        from lightning_gpipe import GPipe

        GPipe(torch.nn.Sequential(torch.nn.LazyLinear(3)))
    model.backbone(torch.zeros(2, M.FEATURES))  # the fix: one forward gives the layer its shape
    _fit(model)


def test_the_children_of_a_partitioned_backbone_listed_by_user_code_stop_every_rank_naming_the_fix():
    # on stage 1 the first child is layer 3, not layer 0: freezing "the first two children" in a callback froze
    # stage 1's first layers as well as stage 0's (4.2e-2 off one device, no error); torch's and Lightning's own
    # traversals (train(), apply, BackboneFinetuning) still list this stage's layers
    outcome = run_processes(W.indexed_in_hook, 2, "children", timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    for rank, layers in enumerate(([0, 1, 2], [3, 4, 5, 6])):
        report = outcome.errors[rank]
        assert f"holds only layers {layers} (stage {rank}), so listing its `children()` would see" in report, report
        assert "use `named_children()` (the names are the whole Sequential's)" in report


@pytest.mark.parametrize("select", ["index", "slice", "name"])
def test_selecting_a_layer_another_stage_holds_stops_every_rank_naming_the_layer_its_stage_and_the_fix(select):
    # by name (`self.backbone.layer0` in an OrderedDict Sequential) it was a bare AttributeError on stage 1
    outcome = run_processes(W.indexed_in_hook, 2, select, timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    report = outcome.errors[1]
    layer = "layer 0 `layer0` (Linear)" if select == "name" else "layer 0 (Linear)"
    assert report.startswith(f"IndexError: The backbone is partitioned over 2 stages: {layer} on stage 0 (rank 0)")
    assert "this process runs stage 1, which holds layers [3, 4, 5, 6]" in report
    prefix = "backbone.layer0." if select == "name" else "backbone.0."
    assert f"n.startswith('{prefix}')" in report and "local_layers()" in report and "configure_optimizers" in report
    assert "call the backbone itself (`self.backbone(x)`)" in report and "`checkpoint_sequential`" in report
    # a BaseFinetuning subclass that unfreezes `pl_module.backbone[0:3]` met this with no fix that fits its calls
    assert "give `freeze` and `unfreeze_and_add_param_group` the whole backbone (`pl_module.backbone`)" in report
    if select == "slice":
        assert "layer 1 (Tanh) on stage 0 (rank 0)" in report
    assert outcome.errors[0].startswith("PipelineError: stage 1 (rank 1) failed: IndexError")


def test_a_training_step_that_returns_none_is_refused_by_lightning_on_every_rank():
    # Lightning refuses a skipped step whenever the job has several processes (as under DDP), after the backbone ran:
    # every rank must end, none waiting in the drain of the call it made
    outcome = run_processes(W.fit, 2, "skipped steps", timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    for error in outcome.errors:  # its own, or (had the other rank raised first) the other's, reported
        assert "RuntimeError: Skipping the `training_step` by returning None in distributed training" in error


def test_fitting_a_model_with_nothing_to_train_fails_at_the_backward_on_every_rank_as_on_one_device():
    # the pipeline's output required grad whatever was frozen: the loss backpropagated into a drain that trained
    # nothing, and the fit ran to its end where one device fails at the first backward
    nothing = "RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn"
    with pytest.raises(RuntimeError, match=nothing.removeprefix("RuntimeError: ")):
        L.Trainer(devices=1, **M.trainer_kwargs(max_steps=1)).fit(W.Frozen(), M.loader())
    outcome = run_processes(W.fit, 2, "frozen", timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    for error in outcome.errors:  # its own, or the other rank's, reported
        assert nothing in error


def test_the_sequential_called_through_a_reference_kept_before_the_split_stops_every_rank_naming_the_fix():
    # it ran this stage's layers and met the others on `meta`: "Tensor on device meta is not on the expected device"
    outcome = run_processes(W.fit, 2, "kept reference", timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    for error in outcome.errors:  # its own, or the other rank's, reported
        assert "The backbone's nn.Sequential was called directly, through a reference kept before it was split" in error


def test_zero_redundancy_optimizer_is_refused_on_every_rank_naming_the_optimizer_to_use():
    # it failed in its constructor on the other stages' meta parameters, with an error naming only the meta device
    outcome = run_processes(W.fit, 2, "sharded optimizer state", timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    for error in outcome.errors:
        assert error.startswith("ValueError: torch.distributed.optim.ZeroRedundancyOptimizer is not supported"), error
        assert "hold different layers" in error and "optimizer_class" in error


def test_an_optimizer_that_checks_its_parameters_before_torch_sees_the_meta_layers_and_the_error_says_so():
    outcome = run_processes(W.fit, 2, "checks its parameters", timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    for error in outcome.errors:
        assert error.startswith(
            "RuntimeError: configure_optimizers failed under the gpipe strategy with 2 stages: "
            "ValueError: all parameters must be on one device, got ['cpu', 'meta']"
        ), error
        assert "not p.is_meta" in error
