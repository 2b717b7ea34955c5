"""Skip connections without processes: declarations, the checks at construction, the one-device forward, profiling."""

from __future__ import annotations

import copy
import pickle

import _skip_workers as S
import pytest
import torch
from torch import nn

from lightning_gpipe import GPipe, Namespace, PopAdd, PopCat, Stash, isolate, pop, profile_layers, skippable, stash
from lightning_gpipe.engine.skip import Route, SkipRoutes, SkipTracker, StageSkips, find_skips


def test_a_plain_sequential_with_skips_runs_on_one_device_as_the_same_code_written_by_hand():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4)
    net = nn.Sequential(a, Stash("r"), b, nn.Tanh(), PopAdd("r"), Stash("c"), PopCat("c"))
    h = a(x)
    by_hand = torch.tanh(b(h)) + h
    torch.testing.assert_close(net(x), torch.cat([by_hand, by_hand], dim=1), atol=0, rtol=0)
    torch.testing.assert_close(net(x), net(x), atol=0, rtol=0)  # nothing is left behind between calls


def test_popcat_pads_a_smaller_input_to_the_skip_s_size():
    net = nn.Sequential(Stash("s"), nn.MaxPool2d(2), nn.Upsample(scale_factor=2), PopCat("s"))
    assert net(torch.randn(2, 3, 7, 9)).shape == (2, 6, 7, 9)


def test_isolated_blocks_reuse_one_name_and_namespaces_nest():
    def block() -> nn.Sequential:
        return nn.Sequential(Stash("skip"), nn.Linear(4, 4), PopAdd("skip"))

    inner = [isolate(block()), isolate(block())]
    net = nn.Sequential(*inner, isolate(nn.Sequential(Stash("skip"), nn.Identity())), isolate(PopAdd("skip")))
    with pytest.raises(ValueError, match="pops the skip 'skip' \\(isolated\\), but no layer"):
        find_skips(net)  # the last two are isolated separately: they do not pair
    space = Namespace()
    net = nn.Sequential(
        *inner, isolate(nn.Sequential(Stash("skip"), nn.Identity()), space), isolate(PopAdd("skip"), space)
    )
    assert [(r.stash_layer, r.pop_layer) for r in find_skips(net)] == [(0, 0), (1, 1), (2, 3)]
    outer = isolate(nn.Sequential(*[isolate(block()) for _ in range(2)]))
    assert len({r.key for r in find_skips(nn.Sequential(*outer))}) == 2
    assert net(torch.ones(2, 4)).shape == (2, 4)


def test_namespaces_survive_a_deep_copy_and_a_pickle():
    space = Namespace()
    net = nn.Sequential(isolate(Stash("s"), space), isolate(PopAdd("s"), space))
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert find_skips(clone) == find_skips(net)
        torch.testing.assert_close(clone(torch.ones(1, 2)), torch.full((1, 2), 2.0))


@pytest.mark.parametrize(
    "layers, message",
    [
        (
            [nn.Linear(2, 2), PopAdd("x")],
            "layer 1 \\(PopAdd\\) pops the skip 'x', but no layer of the backbone stashes",
        ),
        ([Stash("x"), nn.Linear(2, 2)], "layer 0 \\(Stash\\) stashes the skip 'x', but no layer of the backbone pops"),
        ([Stash("x"), Stash("x"), PopAdd("x")], "Two stashes of the skip 'x': layer 0 \\(Stash\\) and layer 1"),
        ([Stash("x"), PopAdd("x"), PopAdd("x")], "Two pops of the skip 'x': layer 1 \\(PopAdd\\) and layer 2"),
        ([PopAdd("x"), Stash("x")], "layer 0 \\(PopAdd\\) pops the skip 'x' before layer 1 \\(Stash\\) stashes it"),
    ],
    ids=["pop without stash", "stash never popped", "two stashes", "two pops", "pop before stash"],
)
def test_a_wrong_skip_layout_fails_when_the_pipeline_is_built_naming_the_layers(layers, message):
    with pytest.raises(ValueError, match=message):
        GPipe(nn.Sequential(*layers))  # pipeline-1: no processes needed for the check


def test_one_module_object_placed_twice_is_two_stashes():
    keep = Stash("x")
    with pytest.raises(ValueError, match="Two stashes of the skip 'x'.*isolate"):
        find_skips(nn.Sequential(keep, nn.ReLU(), keep, PopAdd("x")))


def test_stash_and_pop_refuse_undeclared_names_and_calls_outside_a_skippable_forward():
    @skippable(stash=["a"])
    class Wrong(nn.Module):
        def forward(self, x):
            stash("b", x)
            return x

    with pytest.raises(LookupError, match="calls stash\\('b'\\), but it declares stash=\\['a'\\]"):
        Wrong()(torch.ones(1))
    with pytest.raises(RuntimeError, match="outside the forward of a @skippable module"):
        pop("a")
    with pytest.raises(TypeError, match="takes a list of names"):
        skippable(stash="a")
    with pytest.raises(TypeError, match="decorates an nn.Module class"):
        skippable()(int)


def test_a_pop_with_nothing_stashed_in_this_pass_names_the_skip():
    with pytest.raises(LookupError, match="PopAdd pops 'nothing', but nothing is stashed under it"):
        PopAdd("nothing")(torch.ones(1))


def test_a_stage_whose_forward_skips_a_declared_stash_says_which_layer_and_which_stage_waits():
    routes = SkipRoutes([Route(((), "x"), 0, 3)], balance=[2, 2])
    stage = StageSkips(routes, 0)
    with pytest.raises(RuntimeError, match="layer 0 declares the skip 'x', which layer 3 on stage 1 pops, but its"):
        stage.outgoing(SkipTracker(record=True), lambda i: f"layer {i}")


def test_routes_place_each_skip_on_its_stages_in_one_order():
    routes = SkipRoutes(find_skips(S.model()), [2, 2, 2, 3])
    assert routes.pairs() == {(0, 1), (0, 2), (0, 3), (1, 3)}
    assert [r.name for r in routes.leaving(0)[1]] == ["s6", "s1"]  # by stash layer, then pop layer, then name
    assert {src: [r.name for r in rs] for src, rs in routes.arriving(3).items()} == {0: ["s3"], 1: ["x", "s2"]}
    assert routes.leaving(2) == {} and routes.arriving(2) == {0: [r for r in routes.routes if r.name == "s5"]}


def test_profiling_counts_a_skip_in_the_activation_memory_of_its_stash_and_its_pop_layers():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), Stash("s"), nn.Linear(8, 8), nn.Linear(8, 8), PopAdd("s")]
    with_skip = profile_layers(nn.Sequential(*layers), torch.randn(4, 8, requires_grad=True), repeats=1)
    without = profile_layers(
        nn.Sequential(layers[0], nn.Identity(), layers[2], layers[3], nn.Identity()), torch.randn(4, 8), repeats=1
    )
    skip_bytes = 4 * 8 * 4
    assert with_skip.activation_bytes[1] == without.activation_bytes[1] + skip_bytes
    assert with_skip.activation_bytes[4] == without.activation_bytes[4] + skip_bytes
    assert with_skip.activation_bytes[2:4] == without.activation_bytes[2:4]


def test_a_skip_without_the_batch_in_dim_0_is_refused_before_it_leaves_its_stage():
    from lightning_gpipe.engine.stage import StageRunner

    runner = StageRunner([(0, Stash("s"))], 0, [0], None, 2, "never", torch.device("cpu"), 0)
    runner._check_batch_dim((torch.zeros(4, 3),), 4, skip_to=2)  # per sample: fine
    with pytest.raises(
        ValueError, match="A skip that stage 0 stashes for stage 2 has shape \\(3,\\) for a micro-batch of 4"
    ):
        runner._check_batch_dim((torch.zeros(3),), 4, skip_to=2)
