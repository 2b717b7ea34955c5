"""Tied weights across stages train as on one device: real K-process runs against one-device Lightning runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import _models as M
import _tied as T
import lightning as L
import pytest
import torch
from torch import nn

from lightning_gpipe import GPipeStrategy, PipelineError
from lightning_gpipe.checkpointing.optim_state import layout
from lightning_gpipe.engine.tied import find_ties, refuse_ties_outside
from lightning_gpipe.launch import run_ok, run_processes


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def tied_runs(directory):
    """``tied_runs(K)``: every rank's results of the K-stage runs; K=3 resumes K=2's checkpoint, so K=2 runs first."""
    cache: dict[int, list] = {}

    def get(stages: int) -> list:
        if stages == 3:
            get(2)
        if stages not in cache:
            cache[stages] = run_ok(T.sweep, stages, directory, timeout=600)
        return cache[stages]

    return get


def _canonical(name: str) -> str:
    return M.TIED_ALIASES.get(name, name)


def _assert_close(got, expected, what, atol=1e-6):
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("config", [*T.CONFIGS, T.BY_NAME], ids=lambda c: c.name)
def test_tied_weights_across_stages_train_as_on_one_device(stages, config, tied_runs):
    """Losses, every rank's first-step gradients (each copy of a tie gets the whole gradient) and final weights."""
    reference = T.reference(config)
    expected_grads = reference["grads"]
    seen = set()
    for rank, results in enumerate(tied_runs(stages)):
        got = results[config.name]
        _assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), f"rank {rank} losses")
        for name, grad in got["grads"].items():
            _assert_close(grad, expected_grads[_canonical(name)], f"rank {rank}, first-step gradient of {name}")
            seen.add(_canonical(name))
        assert list(got["weights"]) == list(reference["weights"])  # every place of a tie, one-device keys
        for key, value in reference["weights"].items():
            _assert_close(got["weights"][key], value, f"rank {rank}, weight {key}")
        assert got["tied_after_fit"], "the reassembled backbone must share the Parameter objects again"
        # in configure_optimizers, `named_parameters()` lists each tie once, under its one-device name, on every
        # stage (before: once per holder stage and per placeholder, so a count over the model was too large)
        assert got["listed"] == reference["listed"], f"rank {rank}"
    assert seen == set(expected_grads)
    holders = [r for r, results in enumerate(tied_runs(stages)) if results[config.name]["names"]]
    assert holders == [stages - 1]  # only the last stage names its copies differently
    names = tied_runs(stages)[-1][config.name]["names"]
    assert names == {k[len("backbone.") :]: v[len("backbone.") :] for k, v in M.TIED_ALIASES.items()}
    assert tied_runs(stages)[-1][config.name]["devices"]["backbone.6.weight"] == "cpu"  # a real copy, not meta


def test_the_same_layer_object_twice_on_one_stage_trains_as_on_one_device(tied_runs):
    reference = T.reference(T.SAME_LAYER)
    for rank, results in enumerate(tied_runs(2)):
        got = results[T.SAME_LAYER.name]
        _assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), f"rank {rank} losses")
        for key, value in reference["weights"].items():
            _assert_close(got["weights"][key], value, f"rank {rank}, weight {key}")
        assert got["tied_after_fit"]


def test_the_same_layer_object_on_two_stages_is_refused_naming_the_layers_and_the_fix():
    shared = nn.Linear(4, 4)
    sequential = nn.Sequential(nn.Linear(4, 4), shared, nn.ReLU(), shared)
    with pytest.raises(
        ValueError,
        match=r"Layers \[1, 3\] of the Sequential are the same Linear object, but the split "
        r"\(balance=\[2, 2\]\) puts them on stages \[0, 1\].*Keep them on one stage "
        r"with `balance`.*`second.weight = first.weight`",
    ):
        find_ties(sequential, [2, 2])  # GPipe calls it first thing, before any collective
    ties = find_ties(sequential, [1, 3])  # on one stage: an ordinary tie within it
    assert [(t.spots, t.stages) for t in ties] == [(("1.weight", "3.weight"), (1,)), (("1.bias", "3.bias"), (1,))]
    # a layer held inside a later one (a decoder that keeps the encoder layer): it was called "the same Linear object"
    holder = nn.Sequential(shared)  # an outside tester's `TransposedOf(enc)`, the kind that contains the layer
    with pytest.raises(ValueError, match=r"The Linear object of layer 1 is also held inside layer 3 of the Sequential"):
        find_ties(nn.Sequential(nn.Linear(4, 4), shared, nn.ReLU(), holder), [2, 2])
    relu = nn.ReLU()  # a stateless module may sit on two stages
    assert find_ties(nn.Sequential(nn.Linear(4, 4), relu, nn.Linear(4, 4), relu), [2, 2]) == []


def test_a_parameter_shared_with_a_layer_outside_the_backbone_is_refused_at_setup():
    model = M.TiedNet()
    model.head[1] = nn.Linear(8, 6)  # the output layer outside the backbone, tied to the embedding-like layer 0
    model.head[1].weight = model.backbone[4].weight
    model.head.append(nn.Linear(6, M.CLASSES))
    trainer = L.Trainer(strategy=GPipeStrategy(), devices=1, **M.trainer_kwargs())
    with pytest.raises(
        ValueError,
        match=r"`head.1.weight` outside the backbone is the same tensor as "
        r"`backbone.4.weight`.*Move the layer .* into the `backbone` Sequential",
    ):
        trainer.fit(model, M.loader())
    refuse_ties_outside(M.TiedNet(), M.TiedNet().backbone, "backbone.")  # ties inside the backbone are fine


def test_copies_of_a_tie_in_different_param_groups_are_refused():
    with pytest.raises(PipelineError, match="'backbone.0.weight' is in param group 0 on one stage and in group 1"):
        layout(
            [[["backbone.0.weight", "head.1.weight"], []], [["head.1.weight"], ["backbone.0.weight"]]],
            ["backbone.0.weight", "head.1.weight"],
        )


def test_copies_that_diverge_raise_a_pipeline_error_naming_the_parameter_and_the_stages():
    outcome = run_processes(T.diverging, 2, timeout=120)
    assert all(code not in (0, None) for code in outcome.exitcodes), outcome.exitcodes
    for rank in range(2):
        assert outcome.errors[rank].startswith(
            "PipelineError: The copies of the tied parameter `backbone.0.weight` "
            "(`backbone.0.weight`, `backbone.6.weight`) on stages [0, 1] differ: "
            "stage 1 disagree(s) with stage 0"
        ), outcome.errors[rank]


def test_a_tied_checkpoint_is_a_one_device_checkpoint_and_resumes_with_another_k_and_on_one_device(
    tied_runs, directory
):
    path = tied_runs(2)[0]["checkpoint"]
    checkpoint = torch.load(path, weights_only=False)
    expected = torch.load(T.one_device_checkpoint(directory), weights_only=False)  # the same epoch on one device
    assert list(checkpoint["state_dict"]) == list(expected["state_dict"])  # both places of a tie, one-device order
    for key, value in expected["state_dict"].items():
        _assert_close(checkpoint["state_dict"][key], value, f"checkpoint {key}")
    names = [n for n, _ in M.TiedNet().named_parameters()]  # a tied parameter once
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert group["params"] == expected["optimizer_states"][0]["param_groups"][0]["params"] == list(range(len(names)))
    assert group["param_names"] == names
    state, one = checkpoint["optimizer_states"][0]["state"], expected["optimizer_states"][0]["state"]
    assert sorted(state) == sorted(one) == list(range(len(names)))
    for i in one:
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_close(state[i][key], one[i][key], f"optimizer state {i} ({names[i]}) {key}")
    # on one device without this package: loads, is tied, and resumes as the one-device file resumes (Lightning
    # alone does not resume a loader mid-epoch exactly, so the one-device file is the measure here)
    script = textwrap.dedent(f"""
        import sys, torch, lightning as L
        sys.modules["lightning_gpipe"] = None  # this package is not importable here
        import _models as M
        for source, target in [({path!r}, {path + ".resumed"!r}), ({path!r}.replace("tied.ckpt", "one-device.ckpt"),
                                                                  {path + ".expected"!r})]:
            model = M.TiedNet.load_from_checkpoint(source, optimizer="adam")
            assert M.is_tied(model.backbone)
            L.seed_everything(1, verbose=False)
            L.Trainer(devices=1, **M.trainer_kwargs()).fit(model, M.loader(shuffle=False), ckpt_path=source)
            torch.save(model.state_dict(), target)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    resumed, expected_resumed = torch.load(path + ".resumed"), torch.load(path + ".expected")
    for key, value in expected_resumed.items():
        _assert_close(resumed[key], value, f"resumed on one device, {key}")
    # with K=3 (this package resumes the loader mid-epoch): as if the 5 steps had run straight through on one device
    reference = T.reference(T.Config("adam", model=(("optimizer", "adam"),)), T.RESUME_DATA)
    for rank, results in enumerate(tied_runs(3)):
        assert results["resumed"]["tied"]
        for key, value in reference["weights"].items():
            _assert_close(results["resumed"]["weights"][key], value, f"resumed with K=3, rank {rank}, {key}")


def test_the_model_summary_counts_a_tied_parameter_once(tied_runs):
    assert tied_runs(3)[0]["summary"] == sum(p.numel() for p in M.TiedNet().parameters())


def test_a_sparse_embedding_tied_across_stages_is_refused_before_any_collective_naming_the_tie_and_the_fixes():
    # before: the stage of the embedding failed in the dense sum of the copies' gradients at the first drain, and
    # the other stage, waiting in that sum, ended with gloo's "Connection closed by peer"
    from lightning_gpipe.engine.tied import _refuse_sparse_ties

    embedding, output = nn.Embedding(50, 16, sparse=True), nn.Linear(16, 50, bias=False)
    output.weight = embedding.weight  # an LM's input and output embeddings
    sequential = nn.Sequential(embedding, nn.Tanh(), nn.Linear(16, 16), output)
    across = [t for t in find_ties(sequential, [2, 2]) if t.across_stages]
    with pytest.raises(
        ValueError,
        match=r"The tied parameter `0.weight` \(also `3.weight`\) is the weight of a sparse embedding \(`0`, "
        r"sparse=True\), and its copies on stages \[0, 1\].*`sparse=False`",
    ):
        _refuse_sparse_ties(sequential, across)
    embedding.sparse = False
    _refuse_sparse_ties(sequential, across)  # dense: the tie trains as any other
