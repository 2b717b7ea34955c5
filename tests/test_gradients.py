"""``lightning_gpipe.grad_norm`` and ``clip_grad_norm_``: the whole model's gradient norms on every stage.

Real K-process runs (gloo) of a module with a stem, a tied backbone and a head, against one-device runs
without this package that use Lightning's ``grad_norm`` and torch's ``clip_grad_norm_``; then the norm
math and the one-process cases, in this process.
"""

from __future__ import annotations

import math

import _gradients as G
import _models as M
import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn

import lightning_gpipe
from lightning_gpipe import GPipe, clip_grad_norm_, grad_norm
from lightning_gpipe.engine.clipping import global_grad_norm
from lightning_gpipe.engine.gradients import owning_pipe
from lightning_gpipe.engine.pipe import live_pipes
from lightning_gpipe.launch import run_ok

#: (processes, data-parallel replicas): 2 and 3 stages, and 2 replicas of 2 stages.
LAYOUT_IDS = {(2, 1): "K=2", (3, 1): "K=3", (4, 2): "2x2"}


@pytest.fixture(scope="module")
def layouts():
    """``layouts((processes, replicas))``: every rank's results of that layout's runs (run once)."""
    cache: dict[tuple[int, int], list] = {}

    def get(layout: tuple[int, int]) -> list:
        if layout not in cache:
            cache[layout] = run_ok(G.runs, *layout, timeout=300)
        return cache[layout]

    return get


@pytest.fixture(scope="module")
def references():
    """``references(run, replicas)``: the run on one device without this package (cached)."""
    cache: dict[tuple[str, int], dict] = {}

    def get(run: str, replicas: int) -> dict:
        if (run, replicas) not in cache:
            cache[run, replicas] = G.fit(run, None, replicas)
        return cache[run, replicas]

    return get


def _close(got, expected, what, atol=1e-6):
    torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


def _assert_weights(got: dict, expected: dict, what: str) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        _close(got[key], value, f"{what}, weight {key}")


def _cases(kind: str) -> list:
    return [
        pytest.param(layout, run, id=f"{LAYOUT_IDS[layout]}-{run}")
        for layout, names in G.LAYOUTS.items()
        for run in names
        if G.RUNS[run][0] == kind
    ]


@pytest.mark.parametrize("layout, run", _cases("log"))
def test_grad_norm_logged_from_a_hook_is_one_device_grad_norm_on_every_rank(layout, run, layouts, references):
    """Keys (every stage's parameters, one-device names, ties once), order, dtypes and values, every step."""
    expected = references(run, layout[1])
    names = list(expected["records"][0])
    assert "grad_2.0_norm/backbone.4.weight" in names and "grad_2.0_norm/head.1.weight" in names
    assert "grad_2.0_norm/backbone.6.weight" not in names  # tied to backbone.0.weight: once, on one device too
    for rank, results in enumerate(layouts(layout)):
        got = results[run]
        assert len(got["records"]) == len(expected["records"]) == 5
        for step, (norms, reference) in enumerate(zip(got["records"], expected["records"])):
            assert list(norms) == list(reference), f"rank {rank}, step {step}: keys or their order"
            for key, value in reference.items():
                assert norms[key].dtype == value.dtype
                _close(norms[key], value, f"rank {rank}, step {step}, {key}")
        # what reaches the logger (rank 0's is written): the whole model's norms, stage 1's included
        assert sorted(got["logged"]) == sorted(expected["logged"]) and len(got["logged"]) == len(names)
        _close(torch.tensor(list(got["logged"].values())), torch.tensor(list(expected["logged"].values())), "logged")
        _assert_weights(got["weights"], expected["weights"], f"rank {rank}")


def _assert_clipped_as_on_one_device(layout, run, layouts, references) -> None:
    """The returned norm, the same on every rank, and the weights after 5 clipped SGD steps."""
    _, norm_type, max_norm = G.RUNS[run]
    expected = references(run, layout[1])
    totals = torch.stack(expected["records"])
    assert bool((totals > max_norm).all()), f"every step must clip: one-device norms {totals.tolist()}"
    everyone = layouts(layout)
    for rank, results in enumerate(everyone):
        got = results[run]
        _close(torch.stack(got["records"]), totals, f"rank {rank}, norm_type={norm_type}: the returned norms")
        assert torch.equal(torch.stack(got["records"]), torch.stack(everyone[0][run]["records"]))
        _assert_weights(got["weights"], expected["weights"], f"rank {rank}, norm_type={norm_type}")


@pytest.mark.parametrize("layout, run", _cases("clip"))
def test_clip_grad_norm_from_a_hook_clips_as_torch_does_on_one_device(layout, run, layouts, references):
    _assert_clipped_as_on_one_device(layout, run, layouts, references)


@pytest.mark.parametrize("layout, run", _cases("torch clip"))
def test_torchs_own_clip_grad_norm_in_a_hook_clips_by_the_whole_models_norm_as_on_one_device(
    layout, run, layouts, references
):
    """``from torch.nn.utils import clip_grad_norm_``, bound before any pipeline existed, called in the hook."""
    _assert_clipped_as_on_one_device(layout, run, layouts, references)


@pytest.mark.parametrize("layout, run", _cases("torch two steps"))
def test_torchs_get_total_norm_then_clip_grads_with_norm_clips_by_the_whole_models_norm_as_on_one_device(
    layout, run, layouts, references
):
    """torch's documented two steps, by a name bound before any pipeline existed and by torch's own name: each stage
    took its own stage's norm and clipped by it (2.2e-2 off one device after 8 steps in a probe, K=2)."""
    _assert_clipped_as_on_one_device(layout, run, layouts, references)


def test_trainer_gradient_clip_val_clips_by_the_whole_models_norm(layouts, references):
    """``Trainer(gradient_clip_val=...)`` goes through ``lightning_gpipe.clip_grad_norm_`` as well."""
    expected = references("gradient_clip_val", 1)
    for rank, results in enumerate(layouts((2, 1))):
        _assert_weights(results["gradient_clip_val"]["weights"], expected["weights"], f"rank {rank}")


def test_plain_pytorch_module_with_a_two_stage_gpipe_gets_one_process_norms_and_clipping(layouts):
    """No Lightning in the loop: ``grad_norm`` for p = 1, 2, inf and ``clip_grad_norm_`` of ``model.parameters()``."""
    model = G.Plain()
    G.plain_backward(model)
    expected_norms = {p: lightning_grad_norm(model, p) for p in G.NORM_TYPES}
    expected_total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    assert expected_total.item() > 2  # so the gradients are scaled by a factor far from 1
    expected_grads = {n: p.grad for n, p in model.named_parameters()}
    for rank, results in enumerate(layouts((2, 1))):
        got = results["plain"]
        for p, reference in expected_norms.items():
            assert list(got["norms"][p]) == list(reference)
            for key, value in reference.items():
                _close(got["norms"][p][key], value, f"rank {rank}, {key}")
        _close(got["total"], expected_total, f"rank {rank}, the clipping norm")
        for name, grad in got["grads"].items():  # a tied copy by its local name
            _close(grad, expected_grads[M.TIED_ALIASES.get(name, name)], f"rank {rank}, clipped gradient of {name}")
        # torch's own clip_grad_norm_ on the same gradients: routed to the same norm and factor
        _close(got["torch_total"], expected_total, f"rank {rank}, torch's clip_grad_norm_")
        for name, grad in got["torch_grads"].items():
            _close(grad, expected_grads[M.TIED_ALIASES.get(name, name)], f"rank {rank}, torch-clipped {name}")


def test_grad_norm_raises_at_once_when_a_stage_failed_instead_of_waiting_for_it(layouts):
    got = layouts((2, 1))[0]["plain"]
    assert "stage 1" in got["failure"] and "broke before the gradient norm" in got["failure"]
    assert got["failure_seconds"] < 5.0


# -- one process: no pipeline, or a one-stage one; the norm math with group=None -----------------------------------


def _with_gradients(seed: int = 0) -> nn.Module:
    """A small module with gradients, a frozen parameter and one that the loss does not reach (no gradient)."""
    torch.manual_seed(seed)
    model = nn.ModuleDict(
        {"a": nn.Linear(5, 4), "frozen": nn.Linear(4, 4), "b": nn.Linear(4, 3), "unused": nn.Linear(2, 2)}
    )
    model["frozen"].requires_grad_(False)
    x = torch.randn(6, 5)
    (model["b"](model["frozen"](model["a"](x))).square().sum() * 3).backward()
    return model


@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, float("inf"), "inf"])
def test_grad_norm_without_a_pipeline_is_lightnings_bit_for_bit(norm_type):
    model = _with_gradients()
    got, expected = grad_norm(model, norm_type), lightning_grad_norm(model, norm_type)
    assert list(got) == list(expected) and len(expected) == 5  # a and b (weight, bias), the total
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert list(grad_norm(model, 2, group_separator=".")) == list(lightning_grad_norm(model, 2, group_separator="."))


def test_grad_norm_of_a_module_without_gradients_is_empty():
    assert grad_norm(nn.Linear(3, 3), 2) == {} == lightning_grad_norm(nn.Linear(3, 3), 2)


def test_grad_norm_of_a_module_holding_a_one_stage_gpipe_lists_the_one_device_names():
    """The walk puts the pipeline's parameters where one device lists them, each tied parameter once."""
    reference = G.Plain()
    model = G.Plain()
    backbone = model.backbone
    assert isinstance(backbone, nn.Sequential)
    model.backbone = pipe = GPipe(backbone, chunks=2)
    try:
        G.plain_backward(reference)
        G.plain_backward(model)
        for module, expected_module in ((model, reference), (pipe, reference.backbone)):
            got, expected = grad_norm(module, 2), lightning_grad_norm(expected_module, 2)
            assert list(got) == list(expected)
            for key, value in expected.items():
                _close(got[key], value, key)
        assert "grad_2.0_norm/backbone.6.weight" not in grad_norm(model, 2)
    finally:
        pipe.close()


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_clip_grad_norm_without_a_pipeline_is_torchs_bit_for_bit(norm_type):
    model, reference = _with_gradients(), _with_gradients()
    got = clip_grad_norm_(model.parameters(), 0.5, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type)
    assert torch.equal(got, expected) and expected.item() > 0.5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    single = nn.Parameter(torch.ones(3))
    single.grad = torch.full((3,), 2.0)
    assert clip_grad_norm_(single, 1.0, norm_type).item() == torch.linalg.vector_norm(torch.full((3,), 2.0), norm_type)


def test_torchs_clip_grad_norm_is_routed_on_this_torch_and_stays_torchs_own_without_a_live_pipeline():
    """The routing finds its hook in this torch (a torch that moves it fails here, not silently in a fit), and
    with no pipeline of several stages live, torch's function gives what torch's own helper gives, bit for bit."""
    from lightning_gpipe.engine.clipping import TORCH_TOTAL_NORM
    from lightning_gpipe.engine.torch_clipping import route_torch_clip_grad_norm, routed

    assert route_torch_clip_grad_norm() and routed()
    assert not [pipe for pipe in live_pipes() if pipe.group is not None]
    model, reference = _with_gradients(), _with_gradients()
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, 3.0)
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    expected = TORCH_TOTAL_NORM(grads, 3.0)  # torch's helper itself, kept before the routing
    assert torch.nn.utils.get_total_norm is not TORCH_TOTAL_NORM  # torch's public name is routed as well
    assert torch.equal(torch.nn.utils.get_total_norm(grads, 3.0), expected)
    torch.nn.utils.clip_grads_with_norm_(reference.parameters(), 0.5, expected)
    assert torch.equal(got, expected) and expected.item() > 0.5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("norm_type", [0, -1.0, float("-inf"), float("nan"), "two"])
def test_norm_types_that_are_not_positive_are_refused_by_both(norm_type):
    model = _with_gradients()
    with pytest.raises(ValueError, match="`norm_type` must be a positive number or 'inf'"):
        clip_grad_norm_(model.parameters(), 1.0, norm_type)
    if norm_type != "two" and not (isinstance(norm_type, float) and math.isnan(norm_type)):  # as Lightning's
        with pytest.raises(ValueError, match="`norm_type` must be a positive number or 'inf'"):
            grad_norm(model, norm_type)


def _params(*sizes, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for size in sizes:
        p = nn.Parameter(torch.randn(size, generator=generator, dtype=dtype))
        p.grad = torch.randn(size, generator=generator, dtype=dtype) * 3
        params.append(p)
    return params


def _torch_norm(params, norm_type):
    return torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_the_norm_joins_the_shares_of_own_and_replicated_parameters_for_any_p(norm_type):
    own, replicated, copies = _params(5, (3, 4)), _params(2, 6, seed=1), _params(7, seed=2)
    everything = own + replicated + copies

    def norm(count_replicated: bool) -> torch.Tensor:
        return global_grad_norm(
            everything, own + copies, count_replicated, None, counted_elsewhere=copies, norm_type=norm_type
        )

    _close(norm(True), _torch_norm(own + replicated, norm_type), "own and replicated", atol=1e-5)
    _close(norm(False), _torch_norm(own, norm_type), "own only", atol=1e-5)
    alone = global_grad_norm(replicated, own, True, None, norm_type=norm_type)  # no own gradient on this stage
    _close(alone, _torch_norm(replicated, norm_type), "replicated only", atol=1e-5)
    none = global_grad_norm([nn.Parameter(torch.ones(2))], [], True, None, norm_type=norm_type)
    assert none.item() == 0.0 and none.dtype == torch.float32


def test_the_norm_has_the_gradients_dtype_and_refuses_a_non_finite_norm_when_asked():
    own = _params(5, 3, dtype=torch.float64)
    total = global_grad_norm(own, own, True, None, norm_type=3.0)
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, _torch_norm(own, 3.0), atol=1e-12, rtol=1e-12)
    own[0].grad[0] = float("inf")
    assert global_grad_norm(own, own, True, None).isinf()
    with pytest.raises(RuntimeError, match="non-finite"):
        global_grad_norm(own, own, True, None, error_if_nonfinite=True)


def test_pipelines_of_several_stages_are_found_by_their_parameters_and_ambiguity_names_pipe(layouts):
    for rank in layouts((2, 1)):
        assert rank["plain"]["owner_found"]
        assert "2 live GPipe pipelines" in rank["plain"]["ambiguous"] and "pipe=" in rank["plain"]["ambiguous"]


def test_pipelines_of_one_stage_are_live_but_join_no_one():
    first, second = GPipe(nn.Sequential(nn.Linear(3, 3)), chunks=1), GPipe(nn.Sequential(nn.Linear(3, 2)), chunks=1)
    try:
        assert first in live_pipes() and second in live_pipes()
        assert owning_pipe(list(second.parameters())) is None  # one stage alone: torch's own function serves
        assert owning_pipe([nn.Parameter(torch.ones(1))]) is None
        for p in first.parameters():
            p.grad = torch.ones_like(p)
        expected = torch.nn.utils.get_total_norm([p.grad for p in first.parameters()])
        assert torch.equal(lightning_gpipe.clip_grad_norm_(first.parameters(), 1e9, pipe=first), expected)
    finally:
        first.close()
        second.close()
    assert first not in live_pipes() and second not in live_pipes()
