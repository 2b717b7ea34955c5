"""Whole-model state of a partitioned backbone: key order, key checks, each stage's entries, gather and reassembly."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe import GPipe
from lightning_gpipe.checkpointing import model_state
from lightning_gpipe.launch import run_ok


class Scaled(nn.Module):
    """A layer with a non-persistent buffer, which a state_dict leaves out, and extra state (a count, not a tensor),
    which a state_dict holds: reassembly must move both."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("scale", torch.full((width,), 2.0), persistent=False)
        self.count = 0

    def forward(self, x):
        return x * self.scale

    def get_extra_state(self):
        return {"count": self.count}

    def set_extra_state(self, state):
        self.count = state["count"]


def _backbone():
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight  # tied across the two stages of the 2-process test
    return nn.Sequential(first, nn.Tanh(), nn.BatchNorm1d(4), Scaled(4), last)


class Net(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.backbone = backbone
        self.head = nn.Linear(4, 2)


def _one_device_keys():
    return list(Net(_backbone()).state_dict())


class _Stage:
    """What the selection of a stage's entries reads of a pipeline: its layers' indices, and the Sequential's names."""

    def __init__(self, indices, names=None):
        self.indices = indices
        self.layer_names = names or [str(i) for i in range(12)]

    def local_layers(self):
        return [(i, nn.Identity()) for i in self.indices]


# -- merge_backbone --------------------------------------------------------------------------------------------


def test_merge_backbone_puts_the_whole_backbone_where_the_stages_entries_were():
    local = {"embed.weight": 1, "backbone.2.weight": 2, "backbone.2.bias": 3, "head.weight": 4}
    backbone = {"0.weight": 10, "0.bias": 11, "2.weight": 12, "2.bias": 13}
    merged = model_state.merge_backbone(local, backbone, "backbone.")
    assert list(merged) == [
        "embed.weight",
        "backbone.0.weight",
        "backbone.0.bias",
        "backbone.2.weight",
        "backbone.2.bias",
        "head.weight",
    ]
    assert merged["backbone.2.weight"] == 12 and merged["embed.weight"] == 1  # the whole backbone's values


def test_merge_backbone_of_a_real_stage_has_the_key_order_of_a_one_device_state_dict():
    full = Net(_backbone()).state_dict()
    backbone = {k[len("backbone.") :]: v for k, v in full.items() if k.startswith("backbone.")}
    stage = {k: v for k, v in full.items() if not k.startswith("backbone.") or k.startswith("backbone.4.")}
    assert list(model_state.merge_backbone(stage, backbone, "backbone.")) == list(full)


def test_merge_backbone_of_a_first_stage_without_state_when_the_backbone_comes_last():
    local = {"embed.weight": 1}  # its layers hold no state (activations only)
    merged = model_state.merge_backbone(local, {"1.weight": 2, "2.weight": 3}, "backbone.")
    assert list(merged) == ["embed.weight", "backbone.1.weight", "backbone.2.weight"]


def test_merge_backbone_of_a_first_stage_without_state_keeps_one_device_order_with_a_head_after_the_backbone():
    # one device: embed, backbone.*, head; the first stage holds only activations, so its own
    # state_dict has no backbone entry that marks where the backbone goes: the model tells
    net = Net(nn.Sequential(nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4)))
    full = net.state_dict()
    local = {k: v for k, v in full.items() if not k.startswith("backbone.")}
    backbone = {k[len("backbone.") :]: v for k, v in full.items() if k.startswith("backbone.")}
    assert list(model_state.merge_backbone(local, backbone, "backbone.", net)) == list(full)
    assert list(model_state.merge_backbone(local, backbone, "backbone."))[-1].startswith("backbone.")  # no model


# -- check_keys ------------------------------------------------------------------------------------------------


def test_check_keys_passes_for_the_same_keys_in_another_order():
    model_state.check_keys(["a", "b", "c"], ["c", "a", "b"], "Net")


def test_check_keys_names_the_model_and_the_missing_and_unexpected_keys():
    expected = ["embed.weight", "backbone.0.weight", "backbone.1.weight", "head.weight"]
    saved = ["embed.weight", "backbone.0.weight", "backbone.2.weight", "head.weight", "extra"]
    with pytest.raises(
        RuntimeError,
        match=r"does not fit Net: missing keys \['backbone.1.weight'\], unexpected keys "
        r"\['backbone.2.weight', 'extra'\].*strict_loading = False",
    ):
        model_state.check_keys(expected, saved, "Net")
    with pytest.raises(RuntimeError, match=r"missing keys \['head.weight'\], unexpected keys \[\]"):
        model_state.check_keys(expected, expected[:-1], "Net")
    with pytest.raises(RuntimeError, match=r"missing keys \[\], unexpected keys \['backbone.4.weight'\]"):
        model_state.check_keys(expected, [*expected, "backbone.4.weight"], "Net")


# -- local_state_dict ------------------------------------------------------------------------------------------


def test_local_state_dict_keeps_the_stages_layers_and_everything_outside_the_backbone():
    state = {
        "embed.weight": 0,
        "backbone.1.weight": 1,
        "backbone.1.bias": 2,
        "backbone.10.weight": 3,
        "backbone.11.running_mean": 4,
        "backbone.2.weight": 5,
        "backbone_norm.weight": 6,
        "head.weight": 7,
    }
    kept = model_state.local_state_dict(state, _Stage([1, 2]), "backbone.")
    # layer 1 is not layers 10 or 11; "backbone_norm" is outside the backbone
    assert kept == {
        "embed.weight": 0,
        "backbone.1.weight": 1,
        "backbone.1.bias": 2,
        "backbone.2.weight": 5,
        "backbone_norm.weight": 6,
        "head.weight": 7,
    }
    assert list(model_state.local_state_dict(state, _Stage([10, 11]), "backbone.")) == [
        "embed.weight",
        "backbone.10.weight",
        "backbone.11.running_mean",
        "backbone_norm.weight",
        "head.weight",
    ]
    named = {"backbone.embed.weight": 0, "backbone.block.weight": 1, "backbone.out.bias": 2}  # an OrderedDict's
    assert model_state.local_state_dict(named, _Stage([1], ["embed", "block", "out"]), "backbone.") == {
        "backbone.block.weight": 1
    }


def test_local_state_dict_of_a_pipeline_of_one_keeps_every_entry():
    state = Net(_backbone()).state_dict()
    pipe = GPipe(_backbone(), chunks=2)
    assert model_state.local_state_dict(state, pipe, "backbone.") == state


# -- pipeline-1: full_keys, gather_state_dict, reassemble ------------------------------------------------------


def test_full_keys_of_a_pipeline_of_one_are_the_one_device_keys():
    net = Net(_backbone())
    net.backbone = GPipe(net.backbone, chunks=2)
    assert model_state.full_keys(net, net.backbone, "backbone.") == _one_device_keys()
    assert "backbone.3.scale" not in _one_device_keys()  # non-persistent: no key


def test_gather_state_dict_of_a_pipeline_of_one_is_its_sequentials_state_dict_detached():
    expected = _backbone().state_dict()
    pipe = GPipe(_backbone(), chunks=2)
    gathered = model_state.gather_state_dict(pipe)
    assert list(gathered) == list(expected)
    for key, value in expected.items():
        if key.endswith("_extra_state"):
            assert gathered[key] == value
        else:
            assert torch.equal(gathered[key], value) and not gathered[key].requires_grad, key


def test_reassemble_of_a_pipeline_of_one_returns_its_layers_with_the_tie_kept():
    sequential = _backbone()
    layers = list(sequential)
    pipe = GPipe(sequential, chunks=2)
    with torch.no_grad():
        layers[0].weight.add_(1.0)
    full = model_state.reassemble(pipe)
    assert isinstance(full, nn.Sequential) and list(full) == layers
    assert full[0].weight is full[4].weight
    assert torch.equal(full[4].weight, _backbone()[0].weight + 1.0)
    assert torch.equal(full[3].scale, torch.full((4,), 2.0))


# -- two stages ------------------------------------------------------------------------------------------------


def _two_stages(rank, world_size):
    dist.init_process_group("gloo")
    net = Net(_backbone())
    net.backbone = pipe = GPipe(net.backbone, balance=[2, 3], chunks=2)
    with torch.no_grad():  # "trained": every value differs from the initial one
        for p in pipe.parameters():  # the tied copies alike, as an optimizer steps them
            p.add_(1.0)
        for name, buffer in pipe.named_buffers():
            buffer.fill_(0.5 if name.endswith("running_mean") else 3.0)
    for i, layer in pipe.local_layers():
        if isinstance(layer, Scaled):
            layer.count = 7  # extra state changed on the stage that holds the layer
        if i in (1, 2):
            layer.eval()  # a layer put in eval mode, and one frozen, on the stage that holds it
        if i == 4:
            layer.bias.requires_grad_(False)
    try:
        net.state_dict()
        refused = None
    except RuntimeError as error:
        refused = str(error)
    with pipe.stage_state():  # this stage's part, on purpose: outside, a partitioned backbone refuses
        local = net.state_dict(keep_vars=True)
    gathered = model_state.gather_state_dict(pipe)
    result = {
        "refused": refused,
        "gathered": gathered,
        "merged": None if gathered is None else list(model_state.merge_backbone(local, gathered, "backbone.", net)),
        "full_keys": model_state.full_keys(net, pipe, "backbone."),
        "local_keys": list(model_state.local_state_dict(Net(_backbone()).state_dict(), pipe, "backbone.")),
    }
    own = {i: layer for i, layer in pipe.local_layers()}
    full = model_state.reassemble(pipe)
    result["reassembled"] = {name: t.detach().clone() for name, t in [*full.named_parameters(), *full.named_buffers()]}
    result["extra"] = full[3].get_extra_state()
    result["requires_grad"] = {name: p.requires_grad for name, p in full.named_parameters()}
    result["training"] = {name: m.training for name, m in full.named_modules() if name}
    result["tied"] = full[0].weight is full[4].weight
    result["own_layers_kept"] = all(full[i] is layer for i, layer in own.items())
    pipe.close()
    return result


def _trained_backbone():
    expected = _backbone()
    with torch.no_grad():
        for p in expected.parameters():
            p.add_(1.0)
        for name, buffer in expected.named_buffers():
            buffer.fill_(0.5 if name.endswith("running_mean") else 3.0)
    expected[3].count = 7
    return expected


def test_two_stages_gather_the_whole_state_check_the_whole_keys_and_reassemble_the_trained_backbone():
    results = run_ok(_two_stages, 2, timeout=120)
    expected = _trained_backbone()
    one_device = _one_device_keys()

    assert results[1]["gathered"] is None and results[1]["merged"] is None  # the first stage only
    gathered = results[0]["gathered"]
    assert list(gathered) == list(expected.state_dict())  # "4.weight" too: a tied key as one device has it
    for key, value in expected.state_dict().items():
        assert torch.equal(gathered[key], value) if torch.is_tensor(value) else gathered[key] == value, key
    assert results[0]["merged"] == one_device

    for rank in range(2):
        assert results[rank]["full_keys"] == one_device
    # a stage's state under the whole model's keys is refused unless asked for on purpose, naming the stage
    for rank, layers in enumerate(["0-1", "2-4"]):
        refused = results[rank]["refused"]
        assert refused is not None and f"stage {rank} (layers {layers} of 5)" in refused, refused
        assert "`pipe.gather(part, to_all=False)`" in refused and "`with pipe.stage_state():`" in refused
    assert results[0]["local_keys"] == [
        "embed.weight",
        "embed.bias",
        "backbone.0.weight",
        "backbone.0.bias",
        "head.weight",
        "head.bias",
    ]
    assert results[1]["local_keys"] == [k for k in one_device if not k.startswith(("backbone.0.", "backbone.1."))]

    values = dict([*expected.named_parameters(), *expected.named_buffers()])
    for rank in range(2):
        reassembled = results[rank]["reassembled"]
        assert list(reassembled) == list(values)  # the tie is one parameter again: "4.weight" is not listed twice
        for name, value in values.items():
            assert torch.equal(reassembled[name], value), (rank, name)
        assert results[rank]["tied"] and results[rank]["own_layers_kept"]
        # the extra state too (stage 1's layer came back with its initial count on rank 0)
        assert results[rank]["extra"] == {"count": 7}, rank
        # and so do the flags the stages set during the run (they kept the values of the split)
        frozen = {"0.weight": True, "0.bias": True, "2.weight": True, "2.bias": True, "4.bias": False}
        assert results[rank]["requires_grad"] == frozen  # "4.weight" is "0.weight", tied
        assert results[rank]["training"] == {str(i): i not in (1, 2) for i in range(5)}
