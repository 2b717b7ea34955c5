"""Optimizer state keyed by parameter name: stages' states merge into a one-device numbering and map back by name.

Two "stages" are simulated in one process: copies of the same model, each with an optimizer over its
stage's backbone parameters plus the replicated ones outside the backbone (as ``self.parameters()``
of a stage holds them), stepped with the gradients of a one-device run.
"""

import pytest
import torch
from torch import nn

from lightning_gpipe import PipelineError
from lightning_gpipe.checkpointing import optim_state


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 4)
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
        self.unused = nn.Linear(4, 4)  # never gets a gradient: no optimizer state
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.backbone(self.embed(x)))


STAGE_LAYERS = (("backbone.0.", "backbone.2."), ("backbone.3.",))


def _on_stage(stage):
    if stage is None:
        return lambda name: True
    return lambda name: not name.startswith("backbone.") or name.startswith(STAGE_LAYERS[stage])


def _one_group(module, keep):
    return [p for n, p in module.named_parameters() if keep(n)]


def _two_groups(module, keep):
    """Backbone first with its own hyperparameters, then the rest: not the model's order of parameters."""
    backbone = [p for n, p in module.named_parameters() if keep(n) and n.startswith("backbone.")]
    rest = [p for n, p in module.named_parameters() if keep(n) and not n.startswith("backbone.")]
    return [{"params": backbone, "lr": 0.1}, {"params": rest, "lr": 0.05, "weight_decay": 0.01}]


def _train(make_optimizer, groups=_one_group, steps=3, one_device_groups=None):
    """(model, optimizer) of one device, then of stage 0 and stage 1, after the same steps."""
    runs = []
    for stage in (None, 0, 1):
        model = Net()
        make_groups = one_device_groups if stage is None and one_device_groups is not None else groups
        runs.append((model, make_optimizer(make_groups(model, _on_stage(stage)))))
    whole = runs[0][0]
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        whole.zero_grad(set_to_none=True)
        whole(x).square().mean().backward()
        for model, _ in runs[1:]:  # a stage's own parameters get the one-device gradient
            for p, q in zip(model.parameters(), whole.parameters()):
                p.grad = None if q.grad is None else q.grad.clone()
        for _, optimizer in runs:
            optimizer.step()
    return runs


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _full_order():
    return [n for n, _ in Net().named_parameters()]


def _layout(stages):
    return optim_state.layout([optim_state.param_names(o, m) for m, o in stages], _full_order())


def _assert_same_state(got, expected):
    assert sorted(got) == sorted(expected)
    for index in expected:
        assert sorted(got[index]) == sorted(expected[index])
        for key, value in expected[index].items():
            assert torch.equal(got[index][key], value), (index, key)


def test_param_names_name_each_groups_parameters_in_the_optimizers_order():
    model = Net()
    optimizer = torch.optim.SGD(
        [{"params": [model.head.bias, model.embed.weight]}, {"params": [model.backbone[2].weight]}], lr=0.1
    )
    assert optim_state.param_names(optimizer, model) == [["head.bias", "embed.weight"], ["backbone.2.weight"]]


def test_param_names_refuses_a_parameter_outside_the_module():
    model = Net()
    optimizer = torch.optim.SGD([*model.head.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="not in the LightningModule.*self.parameters"):
        optim_state.param_names(optimizer, model)


def test_named_state_keys_the_state_by_parameter_name_and_names_every_parameters_group():
    (model, optimizer), *_ = _train(_adam, _two_groups)
    named = optim_state.named_state(optimizer, model)
    state = optimizer.state_dict()
    names = [n for group in optim_state.param_names(optimizer, model) for n in group]
    assert "unused.weight" not in named["state"]  # Adam keeps nothing for a parameter without gradient
    assert sorted(named["state"]) == sorted(names[i] for i in state["state"])
    for i, value in state["state"].items():
        assert named["state"][names[i]] is value
    assert named["group_of"]["unused.weight"] == 1 and named["group_of"]["backbone.3.bias"] == 0
    assert set(named["group_of"]) == set(_full_order())
    assert named["groups"] == [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    assert [g["lr"] for g in named["groups"]] == [0.1, 0.05]


def test_layout_lists_each_groups_names_over_all_stages_in_model_order():
    full = ["a", "b", "c", "d", "e"]
    local = [[["c", "a"], ["e"]], [["b"], ["e", "d"]]]  # "e" is replicated: on both stages
    assert optim_state.layout(local, full) == [["a", "b", "c"], ["d", "e"]]
    assert optim_state.layout([[["x", "b", "a"]]], full) == [["a", "b", "x"]]  # an unknown name goes last


def test_layout_refuses_stages_with_different_numbers_of_param_groups():
    with pytest.raises(ValueError, match="different numbers of param groups"):
        optim_state.layout([[["a"], ["b"]], [["c"]]], ["a", "b", "c"])


def test_layout_refuses_a_tied_parameter_in_different_groups_on_two_stages():
    with pytest.raises(PipelineError, match=r"tied parameter '0.weight' is in param group 0 .* group 1 on stage 1"):
        optim_state.layout([[["0.weight"], []], [[], ["0.weight"]]], ["0.weight"])


@pytest.mark.parametrize("make_optimizer", [_sgd, _adam], ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("groups", [_one_group, _two_groups], ids=["one-group", "two-groups"])
def test_merge_numbers_states_like_a_one_device_optimizer(make_optimizer, groups):
    (whole, reference), *stages = _train(make_optimizer, groups)
    groups_layout = _layout(stages)
    merged = optim_state.merge([optim_state.named_state(o, m) for m, o in stages], groups_layout)
    expected = reference.state_dict()
    _assert_same_state(merged["state"], expected["state"])
    assert len(expected["state"]) == 9  # every parameter but the two of `unused`
    names = optim_state.param_names(reference, whole)
    assert [g["param_names"] for g in merged["param_groups"]] == names
    hyper = [{k: v for k, v in g.items() if k != "param_names"} for g in merged["param_groups"]]
    assert hyper == expected["param_groups"]
    resumed_model = Net()
    resumed = make_optimizer(groups(resumed_model, _on_stage(None)))
    resumed.load_state_dict(merged)  # the file resumes a one-device run
    _assert_same_state(resumed.state_dict()["state"], expected["state"])


@pytest.mark.parametrize("make_optimizer", [_sgd, _adam], ids=["sgd-momentum", "adam"])
def test_localize_of_a_one_device_state_dict_picks_exactly_the_stages_parameters(make_optimizer):
    (_, reference), *stages = _train(make_optimizer, _two_groups)
    saved = reference.state_dict()
    assert "param_names" not in saved["param_groups"][0]  # numbered only: the layout maps it
    groups_layout = _layout(stages)
    for stage, (model, optimizer) in enumerate(stages):
        local = optim_state.localize(saved, optimizer, model, groups_layout)
        expected = optimizer.state_dict()
        _assert_same_state(local["state"], expected["state"])
        assert local["param_groups"] == expected["param_groups"]
        fresh_model = Net()
        fresh = make_optimizer(_two_groups(fresh_model, _on_stage(stage)))
        fresh.load_state_dict(optim_state.localize(saved, fresh, fresh_model, groups_layout))
        _assert_same_state(fresh.state_dict()["state"], expected["state"])


def test_localize_of_a_merged_state_dict_maps_by_its_param_names_without_a_layout():
    (whole, reference), *stages = _train(_adam, _two_groups)
    merged = optim_state.merge([optim_state.named_state(o, m) for m, o in stages], _layout(stages))
    for model, optimizer in stages:
        local = optim_state.localize(merged, optimizer, model)
        _assert_same_state(local["state"], optimizer.state_dict()["state"])
    one_device = optim_state.localize(merged, reference, whole)  # and a one-device optimizer
    _assert_same_state(one_device["state"], reference.state_dict()["state"])


def test_localize_of_a_one_device_state_dict_written_with_named_parameters():
    # torch writes `param_names` when the optimizer was built from named_parameters(): here the module's own names
    model = Net()
    reference = torch.optim.Adam(model.named_parameters(), lr=0.01)
    model(torch.ones(2, 3)).sum().backward()
    reference.step()
    saved = reference.state_dict()
    assert saved["param_groups"][0]["param_names"] == _full_order()
    stage = Net()
    optimizer = _adam(_one_group(stage, _on_stage(1)))
    local = optim_state.localize(saved, optimizer, stage)
    names = optim_state.param_names(optimizer, stage)[0]
    position = {n: i for i, n in enumerate(_full_order())}
    assert sorted(local["state"]) == [i for i, n in enumerate(names) if not n.startswith("unused.")]
    for i, name in enumerate(names):
        if i in local["state"]:
            assert local["state"][i] is saved["state"][position[name]]


def test_localize_of_a_one_device_state_dict_whose_param_names_are_relative_to_a_submodule():
    # `Adam(self.backbone.named_parameters())` on one device: torch writes "0.weight", not "backbone.0.weight".
    # Those names are not the LightningModule's, but the file is numbered like any one-device file, which
    # the layout maps (as it maps a file without names).
    def named_groups(module, keep):
        named = [(n, p) for n, p in module.named_parameters() if keep(n)]
        return [
            {"params": [(n[len("backbone.") :], p) for n, p in named if n.startswith("backbone.")], "lr": 0.1},
            {"params": [(n, p) for n, p in named if not n.startswith("backbone.")], "lr": 0.05, "weight_decay": 0.01},
        ]

    (_, reference), *stages = _train(_sgd, _two_groups, one_device_groups=named_groups)
    saved = reference.state_dict()
    assert saved["param_groups"][0]["param_names"][:2] == ["0.weight", "0.bias"]
    groups_layout = _layout(stages)
    for model, optimizer in stages:
        local = optim_state.localize(saved, optimizer, model, groups_layout)
        _assert_same_state(local["state"], optimizer.state_dict()["state"])


def test_from_named_round_trips_a_named_state_through_localize():
    for make_optimizer in (_sgd, _adam):
        _, *stages = _train(make_optimizer, _two_groups)
        for stage, (model, optimizer) in enumerate(stages):
            named = optim_state.named_state(optimizer, model)
            fresh_model = Net()
            fresh = make_optimizer(_two_groups(fresh_model, _on_stage(stage)))
            fresh.load_state_dict(optim_state.localize(optim_state.from_named(named), fresh, fresh_model))
            _assert_same_state(fresh.state_dict()["state"], optimizer.state_dict()["state"])
            assert fresh.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_localize_maps_by_the_saved_param_names_before_the_layout():
    # a stage's optimizer given its parameters out of model order: its named state, read back as a sharded
    # checkpoint is, lists them in that order; the strategy passes the layout (model order) too
    _, *stages = _train(_adam, lambda module, keep: list(reversed(_one_group(module, keep))))
    groups_layout = _layout(stages)
    for model, optimizer in stages:
        saved = optim_state.from_named(optim_state.named_state(optimizer, model))
        assert saved["param_groups"][0]["param_names"] == optim_state.param_names(optimizer, model)[0]
        assert saved["param_groups"][0]["param_names"][0] == "head.bias"  # reversed, not the model's order
        local = optim_state.localize(saved, optimizer, model, groups_layout)
        _assert_same_state(local["state"], optimizer.state_dict()["state"])


def test_from_named_reads_a_sharded_named_state_that_dropped_its_empty_state():
    model = Net()
    optimizer = torch.optim.SGD(_two_groups(model, _on_stage(0)), lr=0.1)  # plain SGD keeps no state
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    named = optim_state.named_state(optimizer, model)
    assert named["state"] == {}
    del named["state"]
    local = optim_state.localize(optim_state.from_named(named), optimizer, model)
    assert local == optimizer.state_dict()


def test_from_named_without_group_of_finds_each_parameter_with_state_in_its_own_group():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}])
    model(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    named = optim_state.named_state(optimizer, model)
    del named["group_of"]  # as written before it existed
    local = optim_state.localize(optim_state.from_named(named), optimizer, model)
    _assert_same_state(local["state"], optimizer.state_dict()["state"])
    assert [g["lr"] for g in local["param_groups"]] == [0.001, 0.5]


def test_localize_refuses_another_number_of_param_groups():
    (_, reference), *stages = _train(_sgd, _one_group)
    model, optimizer = stages[0]
    other = torch.optim.SGD(_two_groups(model, _on_stage(0)), lr=0.1)
    with pytest.raises(ValueError, match="has 1 param groups but this one has 2; resume with the same"):
        optim_state.localize(reference.state_dict(), other, model, [_full_order()])


def test_localize_refuses_a_one_device_state_dict_it_cannot_match_by_name():
    (_, reference), *stages = _train(_sgd, _one_group)
    model, optimizer = stages[1]
    saved = reference.state_dict()
    with pytest.raises(ValueError, match=r"Cannot match param group 0 .*\(11 parameters\).*another model"):
        optim_state.localize(saved, optimizer, model)  # no param_names and no layout
    with pytest.raises(ValueError, match="Cannot match param group 0"):
        optim_state.localize(saved, optimizer, model, [_full_order()[:-1]])  # a layout of another length


def test_localize_names_a_parameter_the_checkpoint_lacks():
    (_, reference), *stages = _train(_sgd, _one_group)
    model, optimizer = stages[1]
    renamed = [n.replace("backbone.3.", "backbone.4.") for n in _full_order()]
    with pytest.raises(ValueError, match="has no state for parameter 'backbone.3.weight' in group 0"):
        optim_state.localize(reference.state_dict(), optimizer, model, [renamed])
