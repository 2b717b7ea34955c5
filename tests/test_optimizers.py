"""Optimizers over part of the model: real 2-stage runs against one-device Lightning runs without this package.

A stage with nothing to train (a frozen feature extractor, an optimizer over layers of another stage),
param groups added while training (BackboneFinetuning) through checkpoints and resumes, and the
refusal of LBFGS, whose step needs the whole gradient. All pipeline runs are one spawn of 2 processes.
"""

from __future__ import annotations

import os

import _optimizers as O
import pytest
import torch

from lightning_gpipe.checkpointing.files import consolidate
from lightning_gpipe.engine.clipping import global_grad_norm
from lightning_gpipe.engine.optimizers import accept_empty_parameter_lists, needs_whole_gradient
from lightning_gpipe.launch import run_processes

STAGES = 2


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("optimizers"))
    O.one_device_files(path)  # before the spawn: the pipeline resumes from them
    return path


@pytest.fixture(scope="module")
def outcome(directory):
    """Every rank's results; every rank ends with exit code 1 after the refused runs (by design)."""
    return run_processes(O.everything, STAGES, directory, timeout=400)


@pytest.fixture(scope="module")
def ranks(outcome):
    assert all(code is not None for code in outcome.exitcodes), f"hung ranks after {outcome.seconds:.0f}s"
    assert all(result is not None for result in outcome.results), "\n".join(t or "" for t in outcome.tracebacks)
    return outcome.results


@pytest.fixture(scope="module")
def reference(directory):
    """``reference(name)``: the one-device run of that name, run once (in this process, without the pipeline)."""
    one = os.path.join(directory, "one")
    runs = {
        "frozen": lambda: O.picky("frozen", pipeline=False),
        "frozen-value": lambda: O.picky("frozen-value", pipeline=False),
        "subset": lambda: O.picky("subset", pipeline=False),
        "frozen from pipe": lambda: O.picky(
            "frozen", pipeline=False, ckpt_path=os.path.join(directory, "pipe", "frozen", f"step={O.SAVE_STEP}.ckpt")
        ),
        "finetune": lambda: O.finetune(pipeline=False),
        "finetune from pipe 1": lambda: O.finetune(pipeline=False, ckpt_path=O.finetune_sources(directory)["pipe 1"]),
        **{
            f"finetune from one {epoch}": (
                lambda epoch=epoch: O.finetune(
                    pipeline=False,
                    ckpt_path=O.finetune_sources(directory)[f"one {epoch}"],
                    save_dir=os.path.join(one, "finetune-from", f"one-{epoch}"),
                )
            )
            for epoch in (0, 1)
        },
    }
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = runs[name]()
        return cache[name]

    return get


def assert_same_weights(got: dict, expected: dict, what: str, atol: float = 1e-6) -> None:
    """Every weight of ``got`` equals ``expected``'s, except another stage's after a sharded run (``None``)."""
    assert list(got) == list(expected), what
    for key, value in expected.items():
        if got[key] is not None:
            torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=lambda m: f"{what}, {key}: {m}")


def _load(path: str) -> dict:
    return consolidate(path) if os.path.isdir(path) else torch.load(path, weights_only=True)


# -- a stage with nothing to train --------------------------------------------------------------------------


def test_an_optimizer_built_from_no_parameters_gets_one_empty_group_that_steps_saves_and_schedules():
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop):
        with accept_empty_parameter_lists() as emptied:
            optimizer = cls(filter(lambda p: p.requires_grad, []), lr=0.1)
            kept = cls([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        assert emptied == [optimizer], cls  # the one with parameters is built as usual
        assert [g["params"] for g in optimizer.param_groups] == [[]] and len(kept.param_groups[0]["params"]) == 1
        assert optimizer.param_groups[0]["lr"] == 0.1  # the defaults, as one device's single group has them
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        optimizer.zero_grad()
        assert optimizer.step(lambda: torch.tensor(3.0)) == 3.0  # the closure runs: it is the training step
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == 0.05
        optimizer.load_state_dict(optimizer.state_dict())
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        torch.optim.SGD([], lr=0.1)  # torch's own check is back once the context is left


def test_a_stage_without_any_gradient_makes_its_norm_share_on_the_pipelines_device():
    # with NCCL the all-reduce of the stages' shares needs a CUDA tensor on a frozen stage too; here "meta"
    # stands for the pipeline's device: the share is made there when no gradient says where
    frozen = [torch.nn.Parameter(torch.ones(2))]
    total = global_grad_norm(frozen, frozen, True, None, device=torch.device("meta"))
    assert total.device.type == "meta"
    assert global_grad_norm(frozen, frozen, True, None).device.type == "cpu"  # the default without a device


def _same_losses_and_weights(name, ranks, reference):
    """Every rank's run ``name`` has one device's losses and weights; returns one device's run."""
    expected = reference(name)
    for rank, results in enumerate(ranks):
        got = results[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), atol=1e-6, rtol=0)
        assert_same_weights(got["weights"], expected["weights"], f"rank {rank}")
    return expected


def test_a_frozen_first_stage_without_a_head_trains_as_on_one_device(ranks, reference):
    # stage 0's layers are all frozen and nothing lies outside the backbone: its optimizer holds nothing,
    # yet it runs the loop (Adam, a StepLR, norm clipping) with the other stage
    expected = _same_losses_and_weights("frozen", ranks, reference)
    for results in ranks:
        assert results["frozen"]["lrs"] == expected["lrs"]  # the scheduler stepped the empty optimizer too
    assert [results["frozen"]["local group sizes"] for results in ranks] == [[0], expected["local group sizes"]]


def test_value_clipping_by_the_trainer_and_by_torch_skips_a_stage_without_gradients_as_on_one_device(ranks, reference):
    # torch's clip_grad_value_ fails on a list without gradients ("Expected !nested_tensorlist[0].empty()"), which
    # one device never gives it: the run stopped at the first step on the frozen stage
    _same_losses_and_weights("frozen-value", ranks, reference)


def test_an_optimizer_over_layers_of_another_stage_trains_as_on_one_device(ranks, reference):
    expected = reference("subset")  # SGD over backbone.6 only, which stage 1 holds
    for rank, results in enumerate(ranks):
        assert_same_weights(results["subset"]["weights"], expected["weights"], f"rank {rank}")
    assert [results["subset"]["local group sizes"] for results in ranks] == [[0], [2]]


def test_a_frozen_stage_checkpoint_equals_one_devices_and_resumes_both_ways(ranks, reference, directory):
    name = f"step={O.SAVE_STEP}.ckpt"
    mine, theirs = (_load(os.path.join(directory, where, "frozen", name)) for where in ("pipe", "one"))
    assert list(mine["state_dict"]) == list(theirs["state_dict"])  # nothing extra in the model
    saved, expected = mine["optimizer_states"][0], theirs["optimizer_states"][0]
    assert [len(g["params"]) for g in saved["param_groups"]] == [len(g["params"]) for g in expected["param_groups"]]
    assert saved["param_groups"][0]["param_names"] == [
        "backbone.4.weight",
        "backbone.4.bias",
        "backbone.6.weight",
        "backbone.6.bias",
    ]
    assert list(saved["state"]) == list(expected["state"])
    for i, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][i][key], value, atol=1e-6, rtol=0)
    assert mine["lr_schedulers"] == theirs["lr_schedulers"]
    straight = reference("frozen")["weights"]  # resumed at an epoch's end: the same as never stopped
    for rank, results in enumerate(ranks):
        for source in ("pipe", "one"):
            assert_same_weights(results[f"frozen from {source}"]["weights"], straight, f"rank {rank} from {source}")
    assert_same_weights(reference("frozen from pipe")["weights"], straight, "one device from the pipeline's file")


# -- param groups added while training: BackboneFinetuning ---------------------------------------------------


def test_backbone_finetuning_unfreezes_each_stages_share_and_trains_as_on_one_device(ranks, reference):
    expected = reference("finetune")
    for rank, results in enumerate(ranks):
        got = results["finetune"]
        assert_same_weights(got["weights"], expected["weights"], f"rank {rank}")
        for epoch, (mine, theirs) in enumerate(zip(got["epochs"], expected["epochs"], strict=True)):
            assert mine["lrs"] == theirs["lrs"], epoch
            for name, flag in mine["requires_grad"].items():  # this stage's parameters and the head
                assert flag == theirs["requires_grad"][name], (rank, epoch, name)
    for epoch, theirs in enumerate(expected["epochs"]):  # each group: the stages' shares make one device's
        for g, names in enumerate(theirs["groups"]):
            shares = [results["finetune"]["epochs"][epoch]["groups"][g] for results in ranks]
            assert sorted({n for share in shares for n in share}) == sorted(names), (epoch, g)
    assert [len(e["groups"]) for e in expected["epochs"]] == [1, 2, 2, 2]


@pytest.mark.parametrize("epoch", [0, 1], ids=["before the unfreeze", "after the unfreeze"])
def test_backbone_finetuning_checkpoints_hold_every_stages_param_groups(epoch, ranks, directory):
    theirs = _load(O.finetune_sources(directory)[f"one {epoch}"])
    kept = theirs["callbacks"]["BackboneFinetuning"]["internal_optimizer_metadata"][0]  # one device's group names
    paths = [O.finetune_sources(directory)[f"pipe {epoch}"]]
    if epoch == 1:
        paths.append(O.finetune_sources(directory)["pipe sharded 1"])
    for path in paths:
        mine = _load(path)
        assert mine["callbacks"]["BackboneFinetuning"] == theirs["callbacks"]["BackboneFinetuning"], path
        saved, expected = mine["optimizer_states"][0], theirs["optimizer_states"][0]
        # a sharded file consolidated is numbered as a full one, as one device numbers it
        assert [g["param_names"] for g in saved["param_groups"]] == [g["params"] for g in kept]
        assert len(saved["state"]) == len(expected["state"]) == (2 if epoch == 0 else 10)
        for i, state in expected["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(saved["state"][i][key], value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("source", ["pipe 0", "one 0", "pipe 1", "one 1", "pipe sharded 1"])
def test_backbone_finetuning_resumes_as_one_device_resumes(source, ranks, reference, directory):
    # One device resumed after the unfreeze differs from its uninterrupted run (Lightning #21901: the resumed
    # callback freezes the backbone again in `setup` and never unfreezes it); the pipeline must do the same.
    epoch = int(source[-1])
    expected = reference(f"finetune from one {epoch}")
    if epoch == 0:  # the groups are added after the resume: the same as never stopped
        assert_same_weights(expected["weights"], reference("finetune")["weights"], "one device")
    for rank, results in enumerate(ranks):
        got = results[f"finetune from {source}"]
        assert_same_weights(got["weights"], expected["weights"], f"rank {rank}")
        assert [e["lrs"] for e in got["epochs"]] == [e["lrs"] for e in expected["epochs"]]
    held = {k for results in ranks for k, v in results[f"finetune from {source}"]["weights"].items() if v is not None}
    assert held == set(expected["weights"])  # sharded: each stage's layers on their rank, none missed
    final = f"epoch={O.EPOCHS - 1}.ckpt"
    mine = _load(os.path.join(O.resumed_dir(directory, source), final))
    theirs = _load(os.path.join(directory, "one", "finetune-from", f"one-{epoch}", final))
    assert len(mine["optimizer_states"][0]["state"]) == len(theirs["optimizer_states"][0]["state"]) == 10
    assert mine["callbacks"]["BackboneFinetuning"] == theirs["callbacks"]["BackboneFinetuning"]


def test_one_device_resumes_a_pipeline_checkpoint_with_added_groups(reference):
    assert_same_weights(
        reference("finetune from pipe 1")["weights"], reference("finetune from one 1")["weights"], "one device"
    )


# -- refused at setup -----------------------------------------------------------------------------------------


def test_only_lbfgs_among_torchs_optimizers_needs_the_whole_gradient():
    class Mine(torch.optim.LBFGS):
        pass

    params = [torch.nn.Parameter(torch.ones(2))]
    assert needs_whole_gradient(torch.optim.LBFGS(params)) and needs_whole_gradient(Mine(params))
    others = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad", "Adadelta", "ASGD")
    assert not any(needs_whole_gradient(getattr(torch.optim, name)(params)) for name in others)


def test_lbfgs_with_one_stage_trains_as_on_one_device():
    # the refusal is for several stages only: a one-stage pipeline holds the whole gradient
    expected = O.picky("lbfgs-wolfe", pipeline=False, max_steps=3)
    got = O.picky("lbfgs-wolfe", pipeline=True, devices=1, max_steps=3)
    assert_same_weights(got["weights"], expected["weights"], "pipeline-1")


REFUSALS = {
    "lbfgs": "ValueError: torch.optim.LBFGS is not supported by the gpipe strategy with 2 stages: its step is "
    "computed from the whole gradient",
    "lbfgs-wolfe": "ValueError: torch.optim.LBFGS is not supported by the gpipe strategy with 2 stages",
    "nothing": "ValueError: optimizer got an empty parameter list: configure_optimizers built SGD from no parameters, "
    "on every stage",
    "finetuning, a stage without parameters": "ValueError: The BackboneFinetuning callback is not supported with "
    "balance=[7, 1]: stage 1 (layers 7 to 7 of `backbone`) holds no parameters",
    "finetuning, data-parallel replicas": "ValueError: The BackboneFinetuning callback is not supported with "
    "data-parallel replicas (2 pipelines of 1 stage)",
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_on_every_rank_within_seconds_before_the_first_step(case, ranks, outcome):
    # the worker catches every refusal and returns: each process ends with the status the interpreter gives it, 0
    # (not a fixed 1 after a failure), and none hangs
    assert outcome.exitcodes == [0] * STAGES
    for rank, results in enumerate(ranks):
        got = results["refused"][case]
        assert got["error"] is not None and got["error"].startswith(REFUSALS[case]), (rank, got["error"])
        assert got["batches"] == 0, rank
        assert got["seconds"] < 5.0, (rank, got["seconds"])
    if case.startswith("lbfgs"):
        error = ranks[0]["refused"][case]["error"]
        assert "each stage of the pipeline holds only its own part of the gradient" in error
        assert "Use a first-order optimizer" in error and "devices=1" in error
