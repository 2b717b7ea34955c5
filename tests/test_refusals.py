"""Features the pipeline cannot give the one-device result for, refused before the first step with the fix."""

from __future__ import annotations

import _models as M
import _refusal_workers as W
import lightning as L
import pytest
import torch

from lightning_gpipe import GPipeStrategy
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


@pytest.mark.parametrize("select", ["index", "slice"])
def test_selecting_a_layer_another_stage_holds_stops_every_rank_naming_the_layer_its_stage_and_the_fix(select):
    outcome = run_processes(W.indexed_in_hook, 2, select, timeout=120)
    assert outcome.exitcodes == [1, 1] and max(outcome.ended) < 60
    report = outcome.errors[1]
    assert report.startswith(
        "IndexError: The backbone is partitioned over 2 stages: layer 0 (Linear) on stage 0 (rank 0)"
    )
    assert "this process runs stage 1, which holds layers [3, 4, 5, 6]" in report
    assert "n.startswith('backbone.0.')" in report and "local_layers()" in report and "configure_optimizers" in report
    if select == "slice":
        assert "layer 1 (Tanh) on stage 0 (rank 0)" in report
    assert outcome.errors[0].startswith("PipelineError: stage 1 (rank 1) failed: IndexError")
