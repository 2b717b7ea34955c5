"""The Lightning strategy: launch, predict, checkpoints, pipeline-1, and clear errors for bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import _models as M
import _sweeps
import lightning as L
import pytest
import torch
from torch import nn

from lightning_gpipe import GPipeStrategy


def test_strategy_gpipe_is_registered_on_import():
    trainer = L.Trainer(strategy="gpipe", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, GPipeStrategy)
    assert trainer.strategy.chunks == 4 and trainer.strategy.checkpoint == "except_last"
    assert isinstance(L.Trainer(strategy="gpipe_spawn", accelerator="cpu", devices=1).strategy, GPipeStrategy)


def test_devices_1_is_pipeline_1_micro_batching_and_rematerialization_on_one_device(reference_run):
    config = _sweeps.Config("pipeline-1", strategy=(("chunks", 4), ("checkpoint", "always")))
    got = _sweeps.run_config(config, devices=1)
    reference = reference_run(config)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), atol=1e-6, rtol=0)
    for key, value in reference["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, atol=1e-6, rtol=0)


def test_predict_returns_the_real_outputs(pipeline_runs):
    for rank_results in pipeline_runs(2):
        result = rank_results["predict"]
        model = M.Net()
        model.load_state_dict(result["weights"])
        with torch.no_grad():
            expected = torch.cat([model(x) for x, _ in M.loader(shuffle=False)])
        torch.testing.assert_close(result["predictions"], expected, atol=1e-6, rtol=0)


def test_a_prediction_writer_writes_the_pipelines_predictions_once_from_its_first_stage(pipeline_runs):
    """Lightning's documented writer saves under ``trainer.global_rank`` on every rank: stage 1 holds the same
    predictions as stage 0, so only stage 0 writes, and the files hold each sample once, as one device's would."""
    results = pipeline_runs(2)
    directory = results[0]["predict"]["written"]
    assert results[1]["predict"]["written"] == directory
    batches = len(M.loader(shuffle=False))
    expected = {"predictions_0.pt"} | {f"batch_{i}_0.pt" for i in range(batches)}
    assert set(os.listdir(directory)) == expected  # nothing from rank 1
    whole = torch.cat(torch.load(os.path.join(directory, "predictions_0.pt"))["predictions"])
    torch.testing.assert_close(whole, results[0]["predict"]["predictions"], atol=0, rtol=0)
    per_batch = torch.cat([torch.load(os.path.join(directory, f"batch_{i}_0.pt")) for i in range(batches)])
    torch.testing.assert_close(per_batch, whole, atol=0, rtol=0)


def test_checkpoint_holds_the_whole_model_and_loads_on_one_device_without_this_package(pipeline_runs):
    result = pipeline_runs(2)[0]["checkpoint"]
    checkpoint = torch.load(result["path"], weights_only=False)
    assert list(checkpoint["state_dict"]) == list(M.Net().state_dict())  # original keys, original order
    script = textwrap.dedent(f"""
        import sys, torch
        sys.modules["lightning_gpipe"] = None  # this package is not importable here
        import _models as M
        model = M.Net.load_from_checkpoint({result["path"]!r})
        torch.save(model.state_dict(), {result["path"] + ".loaded"!r})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    loaded = torch.load(result["path"] + ".loaded")
    for key, value in result["weights"].items():
        torch.testing.assert_close(loaded[key], value, atol=0, rtol=0)


def test_spawn_launcher_gives_the_main_process_the_whole_trained_model(reference_run):
    L.seed_everything(0, verbose=False)
    model = M.Net()
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2, start_method="spawn"), devices=2, **M.trainer_kwargs())
    trainer.fit(model, M.loader())
    reference = reference_run(_sweeps.Config("spawn"))
    for key, value in reference["weights"].items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-6, rtol=0)
    assert isinstance(model.backbone, nn.Sequential)


def test_spawn_launcher_after_a_sharded_run_leaves_the_other_stages_on_meta_in_the_main_process(reference_run):
    # nothing is gathered in sharded mode: the main process gets stage 0's trained layers and the head,
    # and the other stage's tensors become meta (never silently the untrained initial weights)
    L.seed_everything(0, verbose=False)
    model = M.Net()
    strategy = GPipeStrategy(chunks=2, start_method="spawn", state_dict_type="sharded", balance=[3, 4])
    trainer = L.Trainer(strategy=strategy, devices=2, **M.trainer_kwargs())
    with pytest.warns(UserWarning, match=r"lightning_gpipe\.checkpointing\.consolidate"):
        trainer.fit(model, M.loader())
    reference = reference_run(_sweeps.Config("spawn"))
    for key, value in model.state_dict().items():
        if key.startswith("backbone.") and int(key.split(".")[1]) >= 3:
            assert value.is_meta, key
        else:
            torch.testing.assert_close(value, reference["weights"][key], atol=1e-6, rtol=0)
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(torch.zeros(2, M.FEATURES))
    # a later run on this copy: refused in the workers, naming why; before, torch's "Cannot copy out of meta tensor"
    # from the profile, and the main process's teardown hid it behind the same error
    with pytest.raises(Exception, match="the main process's copy after a run with state_dict_type='sharded'") as raised:
        trainer.validate(model, M.loader(), verbose=False)
    assert not isinstance(raised.value, NotImplementedError)


def test_model_summary_counts_every_stage_not_only_the_first(pipeline_runs):
    model = M.Net()
    total = sum(p.numel() for p in model.parameters())
    frozen = model.backbone[0].weight.numel()
    summaries = pipeline_runs(2)[0]["summary"]
    assert len(summaries) == 1  # printed once, on rank 0
    assert summaries[0]["total"] == total and summaries[0]["trainable"] == total - frozen
    row = summaries[0]["rows"]["Name"].index("backbone")
    assert summaries[0]["rows"]["Params"][row].strip() == f"{sum(p.numel() for p in model.backbone.parameters())}"
    assert pipeline_runs(2)[1]["summary"] == []
    # with an example input (one that differed per rank: every stage takes the first stage's), the flops, the
    # sizes and the modules in train mode are the whole model's, as one device reports them, and so are the rows
    # of the backbone's layers (max_depth=2), which each rank holds for its own stage only
    (one_device,) = _sweeps.summary_totals(1, pipeline=False)
    assert summaries[0]["flops"] == one_device["flops"] > 0 and summaries[0]["modes"] == one_device["modes"]
    for column in ("Name", "Params", "Mode", "FLOPs", "In sizes", "Out sizes"):  # every layer's row, each stage's
        assert summaries[0]["rows"][column] == one_device["rows"][column], column


# -- bad input -------------------------------------------------------------------------------------------


def _fit(model, strategy, batch_size=8):
    trainer = L.Trainer(strategy=strategy, devices=1, **M.trainer_kwargs(max_steps=1))
    trainer.fit(model, M.loader(batch_size=batch_size))


def test_balance_that_does_not_sum_to_the_layer_count():
    with pytest.raises(ValueError, match=r"`balance=\[6\]` sums to 6 but the backbone has 7 layers"):
        _fit(M.Net(), GPipeStrategy(balance=[6]))


def test_balance_with_the_wrong_number_of_stages():
    with pytest.raises(ValueError, match="`balance` has 2 entries but the pipeline has 1 stages"):
        _fit(M.Net(), GPipeStrategy(balance=[3, 4]))


def test_more_stages_than_layers(pipeline_runs):
    message = pipeline_runs(2)[0]["too many stages"]
    assert "The pipeline has 2 stages but `backbone` has only 1 layers" in message
    assert "at most 1 devices" in message


def test_missing_backbone_names_the_attribute_and_the_fix():
    with pytest.raises(ValueError, match=r"Net has no attribute `features`.*GPipeStrategy\(backbone=...\)"):
        _fit(M.Net(), GPipeStrategy(backbone="features"))


def test_missing_backbone_offers_the_modules_outermost_sequentials_the_largest_first():
    class Vgg(M.Net):  # features and a classifier, as torchvision names them, and no `backbone`
        def __init__(self):
            super().__init__()
            layers = list(self.backbone)
            del self.backbone
            self.features = nn.Sequential(nn.Sequential(*layers[:2]), *layers[2:-1])  # a Sequential inside one
            self.classifier = nn.Sequential(layers[-1])

        def forward(self, x):
            return self.classifier(self.features(x))

    model = Vgg()
    count = {name: sum(p.numel() for p in getattr(model, name).parameters()) for name in ("features", "head")}
    assert count["features"] > count["head"] > 0
    with pytest.raises(ValueError) as error:
        _fit(model, GPipeStrategy())
    message = str(error.value)
    assert "Vgg has no attribute `backbone`" in message
    listed = f"Vgg holds these nn.Sequential attributes: `features` (5 layers, {count['features']:,} parameters), "
    assert listed in message
    assert f"`head` (2 layers, {count['head']:,} parameters)" in message and "`classifier` (1 layers" in message
    assert message.endswith('name the one to pipeline, as in GPipeStrategy(backbone="features").')
    assert "features.0" not in message  # the Sequential inside `features` is not offered


def test_a_second_name_for_the_backbone_is_refused_naming_both_and_the_fix():
    # `self.model = nn.Sequential(...); self.backbone = self.model`: a call through `model` would have run the whole
    # Sequential outside the pipeline; the tie check named a tie of its first layer instead
    model = M.Net()
    model.model = model.backbone
    with pytest.raises(ValueError) as error:
        _fit(model, GPipeStrategy())
    message = str(error.value)
    assert message.startswith("`model` is the backbone itself: `model` and `backbone` are one nn.Sequential under two")
    assert 'GPipeStrategy(backbone="model")' in message


def test_backbone_that_is_not_a_sequential():
    model = M.Net()
    model.backbone = nn.Linear(M.FEATURES, 8)
    with pytest.raises(TypeError, match=r"`Net.backbone` is a Linear.*Make the backbone an nn.Sequential"):
        _fit(model, GPipeStrategy())


def test_a_backbone_that_holds_sequentials_names_them_to_pass_with_the_right_article():
    # a torchvision ResNet (its `layer1`...) or an InvertedResidual ("is a InvertedResidual") named no way out
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Linear(M.FEATURES, M.FEATURES), nn.ReLU(), nn.Linear(M.FEATURES, 8))
            self.extra = nn.Sequential(nn.Identity())

        def forward(self, x):
            return self.features(x)

    model = M.Net()
    model.backbone = Residual()
    with pytest.raises(TypeError, match=r"`Net.backbone` is a Residual, but") as refused:
        _fit(model, GPipeStrategy())
    assert "`backbone.features` (3 layers), `backbone.extra` (1 layer)" in str(refused.value)
    model.backbone = torch.nn.Module()
    model.backbone.__class__ = type("InvertedResidual", (nn.Module,), {"forward": lambda self, x: x})
    with pytest.raises(TypeError, match=r"`Net.backbone` is an InvertedResidual, but"):
        _fit(model, GPipeStrategy())


def test_stage_output_that_is_not_tensors_in_tuples_lists_or_dicts():
    class Namespace(nn.Module):
        def forward(self, x):
            return types.SimpleNamespace(x=x)

    model = M.Net()
    model.backbone.append(Namespace())
    with pytest.raises(TypeError, match=r"Layer 7 \(Namespace\).*got a SimpleNamespace; a stage must return Tensors"):
        _fit(model, GPipeStrategy())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunks": 0}, r"`chunks` must be a positive integer.*Or 'auto'"),
        ({"checkpoint": "sometimes"}, r"`checkpoint` must be one of.*Or 'auto'"),
        ({"balance": "fast"}, "`balance` must be a list of layers per stage or 'params'"),
        # the entries need no backbone: refused before any process starts (the sum and the count, at setup)
        ({"balance": [0, 5]}, r"`balance` must be a list of positive integers \(layers per stage\), got \[0, 5\]"),
        ({"balance": 5}, "`balance` must be a list of positive integers"),
        ({"pipe_size": 0}, "`pipe_size` must be a positive integer"),
        ({"backbone": ""}, "`backbone` must name the attribute"),
        # these were accepted, and failed later inside the run (or never)
        ({"timeout": -1}, r"`timeout` must be a positive number of seconds, got -1"),
        ({"timeout": "600"}, r"`timeout` must be a positive number of seconds, got '600'"),
        ({"failure_timeout": 0}, "`failure_timeout` must be a positive number of seconds"),
        ({"watchdog_grace": True}, "`watchdog_grace` must be a positive number of seconds"),
        ({"start_method": "thread"}, r"`start_method` must be one of \('popen', 'spawn', 'fork', 'forkserver'\)"),
        ({"max_memory": "16 parsecs"}, r"`max_memory`: '16 parsecs' is not a size: write a number and B, KB"),
        ({"max_memory": [1]}, r"`max_memory` must be a positive number of bytes per device \(or a size such as"),
        # it bounds the "auto" choices alone: with none, it was silently ignored
        (
            {"max_memory": "1GiB", "chunks": 2},
            r"`max_memory` bounds the planner's 'auto' choices, but none of chunks=2, ",
        ),
    ],
)
def test_bad_strategy_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPipeStrategy(**kwargs)


def test_numpy_integers_are_taken_as_the_counts_they_are():
    # before: "`balance` must be a list of positive integers ..., got [np.int64(7), np.int64(8)]"
    import numpy as np

    strategy = GPipeStrategy(balance=[np.int64(7), np.int64(8)], chunks=np.int64(4), pipe_size=np.int32(2))
    assert strategy.requested[:2] == ([7, 8], 4) and type(strategy.chunks) is int and strategy.chunks == 4
    assert type(strategy._pipe_size) is int and strategy._pipe_size == 2
    with pytest.raises(ValueError, match="`chunks` must be a positive integer"):
        GPipeStrategy(chunks=np.float64(4.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seed": "x"}, r"`seed` must be an integer .* or None"),
        ({"seed": 1.5}, r"`seed` must be an integer"),
        ({"deferred_batch_norm": "yes"}, r"`deferred_batch_norm` must be True or False, got 'yes'"),
    ],
)
def test_arguments_of_the_wrong_type_fail_at_construction(kwargs, message):
    with pytest.raises(TypeError, match=message):
        GPipeStrategy(**kwargs)


def test_max_memory_takes_a_size_as_the_plan_command_does():
    assert GPipeStrategy(chunks="auto", max_memory="16GiB").max_memory == 16 * 2**30
    assert GPipeStrategy(balance="auto", max_memory=1e9).max_memory == 1e9


def test_pipe_size_that_does_not_divide_the_processes():
    with pytest.raises(ValueError, match="`pipe_size=2` does not divide the 1 processes"):
        _fit(M.Net(), GPipeStrategy(pipe_size=2))
