"""The engine on its own: plain PyTorch, no Lightning, real processes over gloo."""

import random
import types
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _engine_workers import (
    checkpointed_backbone,
    failing_layer,
    hung_layer,
    killed_between_steps,
    plain_pipeline,
    reference,
    targets_of_another_rank,
)
from _scripts import run_script
from torch import nn

from lightning_gpipe import GPipe
from lightning_gpipe.engine.pipe import _CALL_HOOKS, OWN_ATTRIBUTES, _called_aside
from lightning_gpipe.engine.stage_copy import StageCopy
from lightning_gpipe.engine.tied import find_ties
from lightning_gpipe.launch import run_ok, run_processes


def test_plain_pytorch_targets_are_checked_across_stages_once_the_steps_fingerprint_covers_them():
    # the engine sees the pipe's input alone: targets that differ on rank 1 trained from the last stage's while rank
    # 0 reported a loss of its own; the fingerprint of (input, targets), set as the README shows, stops the call
    unchecked = run_ok(targets_of_another_rank, 2, False, timeout=120)
    assert unchecked[0].startswith("loss ") and unchecked[1].startswith("loss ") and unchecked[0] != unchecked[1]
    checked = run_processes(targets_of_another_rank, 2, True, timeout=120)
    assert checked.exitcodes == [0, 0], checked.errors
    assert checked.results[1].startswith("PipelineError: stage 0 (rank 0) and stage 1 hold different batches in"), (
        checked.results
    )
    assert not checked.results[0].startswith("loss ")  # rank 0 learns of it too, instead of training on


def test_plain_pytorch_two_process_pipeline_matches_one_process_without_lightning_from_rank_zeros_weights():
    ref_loss, ref_grads, ref_input_grad = reference()
    results = run_ok(plain_pipeline, 2, [4, 4], 3, timeout=120)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert set(grads) == set(ref_grads)  # each process holds its own stage's layers, under their own names
    assert set(results[0]["grads"]).isdisjoint(results[1]["grads"])
    for rank in range(2):
        assert results[rank]["started_from_rank_zero"]  # rank 1 built other weights and took rank 0's
        assert results[rank]["loss"] == pytest.approx(ref_loss, abs=1e-6)
        assert not results[rank]["lightning_imported"]
        # the gradient of the pipeline's input reaches every stage (a layer before the pipe needs it)
        torch.testing.assert_close(results[rank]["input_grad"], ref_input_grad, atol=1e-6, rtol=0)
        # the output requires grad where one process's would: not behind a frozen backbone and a plain input
        # (it did, so a loss of it alone ran a drain that trained nothing where one device fails at the backward)
        expected = {"everything": False, "but the input": True, "but the last stage": True, "but the first stage": True}
        assert results[rank]["frozen"] == expected
        # the Sequential called through a reference kept before the split: torch's "Tensor on device meta is not on
        # the expected device" before, which named no cause
        assert results[rank]["aside"].startswith("The backbone's nn.Sequential was called directly, through a")
        assert "(`self.backbone(x)`, looked up at each call)" in results[rank]["aside"]
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=0)
    # iterating a partitioned backbone would see some layers on some ranks only: refused on every rank
    for rank, layers in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        assert results[rank]["iteration"].startswith(
            f"The backbone is partitioned over 2 stages and this process holds only layers {layers} (stage {rank})"
        )
        assert "local_layers()" in results[rank]["iteration"]
        assert "code that runs them one by one (a loop, torch's `checkpoint_sequential`)" in results[rank]["iteration"]


def _deep(width=64, depth=8, dropout=0.0):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Dropout(dropout) if dropout else nn.Tanh()]
    return nn.Sequential(*layers)


def _saved_bytes(pipe, x):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pipe(x)
    return out, sum(saved)


def test_checkpoint_always_keeps_only_the_micro_batch_inputs_between_fill_and_drain():
    x = torch.randn(32, 64)
    pipe = GPipe(_deep(), chunks=4, checkpoint="always")
    out, saved = _saved_bytes(pipe, x)
    assert saved == 0  # no activation of any layer is kept for the backward
    run = out.grad_fn.run  # what the autograd bridge keeps for the drain
    assert all(o is None for o in run.outputs)
    assert [tuple(i.shape) for i in run.inputs] == [(8, 64)] * 4
    assert all(i.data_ptr() == x[8 * k :].data_ptr() for k, i in enumerate(run.inputs))  # views, not copies

    never = GPipe(_deep(), chunks=4, checkpoint="never")
    _, saved_never = _saved_bytes(never, x)
    # every Linear keeps its input and every Tanh its output: 16 activations of 32x64 floats
    assert saved_never >= 16 * 32 * 64 * 4
    out.sum().backward()  # the drain recomputes and still produces gradients
    assert all(p.grad is not None for p in pipe.parameters())


def test_recompute_replays_the_dropout_masks_of_the_first_forward():
    x = torch.randn(16, 64)
    grads = {}
    for mode in ("always", "never"):
        pipe = GPipe(_deep(dropout=0.5), chunks=4, checkpoint=mode, seed=3)
        pipe(x).square().sum().backward()
        grads[mode] = [p.grad for p in pipe.parameters()]
    for a, b in zip(grads["always"], grads["never"]):
        assert torch.equal(a, b)


def test_randomness_is_keyed_per_call_and_micro_batch_and_leaves_the_callers_generator_alone():
    x = torch.ones(8, 64)
    pipe = GPipe(nn.Sequential(nn.Dropout(0.5)), chunks=2, seed=3)
    torch.manual_seed(5)
    first, second = pipe(x), pipe(x)
    assert not torch.equal(first, second)  # a new call draws new masks
    assert not torch.equal(first[:4], first[4:])  # each micro-batch its own
    after = torch.rand(1)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(1), after)  # the pipeline did not consume the caller's random numbers


def test_stage_output_that_is_not_a_tensor_names_the_layer():
    class ToNamespace(nn.Module):
        def forward(self, x):
            return types.SimpleNamespace(x=x)

    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), ToNamespace()), chunks=2)
    with pytest.raises(TypeError, match=r"Layer 1 \(ToNamespace\), the last of stage 0, got a SimpleNamespace; a st"):
        pipe(torch.randn(4, 4))


def test_the_pipe_takes_its_input_by_nn_sequentials_keyword_as_one_device_does():
    sequential = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(4, 4)
    expected = sequential(input=x)  # `input` is nn.Sequential.forward's name: a call by keyword works there
    pipe = GPipe(sequential, chunks=2)
    torch.testing.assert_close(pipe(input=x), expected)
    torch.testing.assert_close(pipe.forward(x), expected)


def test_an_error_raised_by_a_layer_names_the_layer_stage_and_micro_batch_and_keeps_its_type():
    # a BatchNorm that one device gives the whole batch of 3 gets a micro-batch of 1 here: torch's bare error named
    # neither the layer nor the cut
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), chunks=2)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as caught:
        pipe(torch.randn(3, 4))
    (note,) = caught.value.__notes__
    assert note.startswith("(raised by layer 1 (BatchNorm1d) on stage 0 on micro-batch 1, of 1 sample: the pipeline")
    assert "give every batch at least 2 x chunks samples" in note
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2)), chunks=2)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as caught:
        pipe(torch.randn(3, 4))
    assert caught.value.__notes__ == [  # at the first call, the layers run first in the per-sample check
        "(raised by layer 1 (Linear) on micro-batch 0, of 2 samples, run first, in eval mode, to check that the "
        "layers keep the samples apart: the pipeline cuts each batch into `chunks` micro-batches)"
    ]


@pytest.mark.parametrize("in_backward", [False, True], ids=["stage 0's fill", "stage 1's drain"])
def test_a_layer_error_in_a_plain_pipeline_reaches_the_other_stage_with_its_cause(in_backward):
    # without Lightning nothing published the error: the stage waiting for the failed one's messages said only
    # "stage 0 (rank 0) closed its link while this stage still expected a message" once the failed rank closed its pipe
    outcome = run_processes(failing_layer, 2, in_backward, timeout=120)
    assert outcome.exitcodes == [0, 0], outcome.errors
    failed, other = (1, 0) if in_backward else (0, 1)
    where = "backward" if in_backward else "forward"
    assert outcome.results[failed].startswith(f"ValueError: boom in {where}"), outcome.results
    assert outcome.results[other].startswith(
        f"PipelineError: stage {failed} (rank {failed}) failed: ValueError: boom in {where}"
    ), outcome.results


def test_a_layer_that_never_returns_fails_the_waiting_stage_after_timeout_and_its_watchdog_ends_its_rank():
    # a computing stage keeps its heartbeat, so only `timeout` bounds it; the message named GPipeStrategy alone
    outcome = run_processes(hung_layer, 2, timeout=120)
    error = outcome.results[0]
    assert error.startswith("PipelineError: No message from stage 1 (rank 1) for 2s; it is hung or gone"), error
    assert "`failure_timeout` does not cover it" in error and "GPipe(timeout=...)" in error
    assert outcome.exitcodes[1] == 1 and outcome.ended[1] is not None  # its watchdog ended it, not the harness


def test_a_send_to_a_stage_that_was_killed_names_the_stage_instead_of_the_transports_address():
    # gloo's "Connection closed by peer [127.0.0.1]:54488" came out of dist.isend bare, naming no stage
    outcome = run_processes(killed_between_steps, 2, timeout=120)
    assert outcome.exitcodes == [0, 3], outcome.errors
    error = outcome.results[0]
    assert error.startswith("PipelineError: Lost the connection to stage 1 (rank 1) during a send to stage 1"), error
    assert "ended without reporting an error" in error and "The transport said: RuntimeError: " in error


def test_the_backbone_inside_torchs_checkpoint_trains_when_reentrant_and_is_refused_at_once_otherwise():
    # the non-reentrant form recomputes the region from inside each stage's drain, at a different moment on each
    # stage: the stages waited for each other until the deadlock check named it (24 s in a probe, failure_timeout 10)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    net(x).square().mean().backward()
    for got in run_ok(checkpointed_backbone, 2, True, timeout=120):
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, dict(net.named_parameters())[name].grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(got["input_grad"], x.grad, atol=1e-6, rtol=0)
    outcome = run_processes(checkpointed_backbone, 2, False, timeout=120)
    assert all(code not in (0, None) for code in outcome.exitcodes) and outcome.seconds < 60, outcome.exitcodes
    assert outcome.errors[1].startswith("RuntimeError: The backbone was called while stage 1 back-propagated backbone")
    assert "use_reentrant=False" in outcome.errors[1] and "GPipeStrategy(checkpoint=...)" in outcome.errors[1]


def test_a_backbone_output_with_a_value_beside_its_tensors_is_refused_naming_the_layer_but_none_is_kept():
    # the micro-batches' outputs join tensor by tensor: a count beside them would be one micro-batch's (4, not 8)
    class WithCount(nn.Module):
        def forward(self, x):
            return x, x.shape[0]

    class WithNone(nn.Module):
        def forward(self, x):
            return {"x": x, "aux": None} if x.shape[0] > 3 else [x, None]

    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), WithCount()), chunks=2)
    with pytest.raises(ValueError, match=r"Layer 1 \(WithCount\), the backbone's last, returned 4 beside its tensors"):
        pipe(torch.randn(8, 4))
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), WithNone()), chunks=2)
    out = pipe(torch.randn(8, 4))
    assert out["x"].shape == (8, 4) and out["aux"] is None
    with pytest.raises(ValueError, match=r"Layer 1 \(WithNone\), the backbone's last, returned outputs of different"):
        pipe(torch.randn(7, 4))  # micro-batches of 4 and 3: a dict, then a list


def test_dicts_namedtuples_dataclasses_and_constants_cross_every_boundary_as_in_one_process():
    # every boundary of this backbone carries a structure (a dict with None and a float, a namedtuple around a
    # dataclass with a bool tensor, a string and a complex spectrum), and so does its output (a dict with an int tensor
    # and a None). A complex tensor counted as not differentiable: the stages before it got no gradient through it
    from _engine_workers import structured_pipeline, structured_reference

    ref_loss, ref_grads, ref_positive = structured_reference()
    settings = [([2, 2, 3], "always"), ([1, 3, 3], "never"), ([3, 3, 1], "except_last"), ([4, 2, 1], "always")]
    results = run_ok(structured_pipeline, 3, settings, timeout=120)
    for index, setting in enumerate(settings):
        grads = {}
        for rank in range(3):
            got = results[rank][index]
            assert got["loss"] == pytest.approx(ref_loss, abs=1e-6), setting
            assert torch.equal(got["positive"], ref_positive) and got["aux"] is None, setting
            grads.update(got["grads"])
        assert set(grads) == set(ref_grads)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=0)


def test_layers_drawing_from_python_and_numpy_train_alike_for_every_k_and_checkpoint_mode_and_leave_callers_draws():
    # a LayerDrop that draws `random.random()` or `np.random.uniform()`, and noise from a `random.Random` and a NumPy
    # Generator the layer holds. Before, each stage drew from its own process's state, and a recompute drew again:
    # 0.17-0.33 apart in loss between K and checkpoint modes over 6 steps, without a word
    from _engine_workers import host_random_training

    state = random.getstate(), np.random.get_state()
    (reference,) = host_random_training(0, 1, [([8], "never")])  # one stage, in this process
    random.setstate(state[0])
    np.random.set_state(state[1])
    settings = [([2, 3, 3], "always"), ([3, 3, 2], "except_last"), ([1, 4, 3], "never")]
    results = run_ok(host_random_training, 3, settings, timeout=120)
    for index, setting in enumerate(settings):
        weights = {}
        for rank in range(3):
            got = results[rank][index]
            assert got["losses"] == reference["losses"], (setting, rank)
            # each process's own draws go on from where they were, untouched by the pipe's keyed streams
            assert got["callers_draws"] == _callers_draws(100 + rank), (setting, rank)
            weights.update(got["weights"])
        assert weights.keys() == reference["weights"].keys()
        for name, value in reference["weights"].items():
            assert torch.equal(weights[name], value), (setting, name)
    assert len(set(reference["losses"])) > 1


def test_a_layer_that_starts_drawing_from_python_after_the_first_call_warns_once_and_is_keyed_from_then_on():
    # the first call in each mode finds which layers draw, and only those stages seed Python's generator from then on;
    # a draw in a later call may be a layer's or another thread's (a logger's), so the stage warns and seeds from then
    class Late(nn.Module):
        drawing = False

        def forward(self, x):
            return x * random.random() if self.drawing else x

    def grads(pipe: GPipe) -> list[torch.Tensor]:
        pipe.zero_grad()
        pipe(torch.ones(4, 4)).sum().backward()
        return [p.grad.clone() for p in pipe.parameters()]

    late = Late()
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), late), chunks=2, checkpoint="always")
    state = random.getstate()
    grads(pipe)
    assert random.getstate() == state
    late.drawing = True
    with pytest.warns(UserWarning, match=r"drawn from while stage 0 ran pipeline call 1.*another thread.*From now on"):
        grads(pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        keyed = grads(pipe)
    never = GPipe(nn.Sequential(pipe[0], Late()), chunks=2, checkpoint="never", seed=pipe.seed)
    never[1].drawing = True
    never.runner.calls = 2  # the same call: the same keys
    random.setstate(state)
    assert all(torch.equal(a, b) for a, b in zip(keyed, grads(never)))  # the recompute drew what the forward drew


def _callers_draws(seed: int) -> tuple[float, float]:
    random.seed(seed)
    np.random.seed(seed)
    return random.random(), float(np.random.uniform())


def test_output_without_the_batch_in_dim_0_is_rejected():
    class Total(nn.Module):
        def forward(self, x):
            return x.sum(0, keepdim=True)

    with pytest.raises(ValueError, match="keep the batch in dim 0"):
        GPipe(nn.Sequential(Total()), chunks=2)(torch.randn(4, 4))


def test_empty_batch_is_rejected_by_the_pipeline():
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4)), chunks=8)
    with pytest.raises(ValueError, match=r"The batch has 0 samples"):
        pipe(torch.randn(0, 4))


def test_gpipe_needs_a_sequential():
    with pytest.raises(TypeError, match="splits an nn.Sequential, got Linear"):
        GPipe(nn.Linear(2, 2))


def test_a_torchgpipe_call_in_one_process_is_refused_naming_one_process_per_stage():
    # torchgpipe's GPipe(model, balance=[2, 1], devices=[...]) puts every stage in one process; this GPipe runs one
    # stage per process, and without torch.distributed the balance failed with "the pipeline has 1 stages"
    layers = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"no `devices` list .* one stage per process .*torchrun --nproc-per-node K"):
        GPipe(layers, balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"`balance=\[2, 1\]` asks for 2 stages, but torch.distributed is not init"):
        GPipe(layers, balance=[2, 1], chunks=2)


def test_pipeline_of_one_matches_plain_module_under_no_grad_and_with_grad():
    x = torch.randn(12, 64)
    module = _deep()
    expected = module(x)
    pipe = GPipe(_deep(), chunks=3)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), expected, atol=1e-6, rtol=0)
    F.mse_loss(pipe(x), torch.zeros_like(expected)).backward()
    F.mse_loss(expected, torch.zeros_like(expected)).backward()
    for a, b in zip(pipe.parameters(), module.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)


def test_a_pipeline_of_one_stage_iterates_like_its_sequential():
    sequential = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    layers = list(sequential)
    assert list(GPipe(sequential)) == layers and len(GPipe(nn.Sequential(nn.Tanh(), nn.ReLU()))) == 2


def _named() -> nn.Sequential:
    return nn.Sequential(OrderedDict(embed=nn.Linear(4, 4), act=nn.Tanh(), head=nn.Linear(4, 4)))


def test_layers_named_in_an_ordered_dict_keep_their_names_in_the_pipeline_and_its_stage_copies():
    # a stage registered its layers as "0", "1", ...: parameters selected by name were missing on every stage
    sequential = _named()
    names, keys = [n for n, _ in sequential.named_parameters()], list(sequential.state_dict())
    pipe = GPipe(sequential, chunks=2)
    assert [n for n, _ in pipe.named_parameters()] == names and list(pipe.state_dict()) == keys
    assert pipe.head is pipe[2] is sequential.head and list(pipe[0:2]._modules) == ["embed", "act"]
    with pytest.raises(AttributeError, match="no attribute 'tail'"):
        getattr(pipe, "tail")  # noqa: B009  (an attribute that is no layer stays an AttributeError)
    x = torch.randn(6, 4)
    torch.testing.assert_close(pipe(x), sequential(x))
    copy = StageCopy(_named(), [2, 1], 1, lambda obj, to_all=True: [obj])  # stage 1 of 2: the head alone
    assert [i for i, _ in copy.local_layers()] == [2] and copy.elsewhere == ["embed.weight", "embed.bias"]
    tied = _named()
    tied.head.weight = tied.embed.weight
    assert [tie.spots for tie in find_ties(tied, [2, 1])] == [("embed.weight", "head.weight")]


def test_a_layer_named_like_an_attribute_of_the_pipeline_is_refused_naming_it_and_every_attribute_is_listed():
    with pytest.raises(
        ValueError, match=r"Layer 1 of the backbone is named `stage`.*Rename the layer \(e.g. `stage_`\)"
    ):
        GPipe(nn.Sequential(OrderedDict(embed=nn.Linear(2, 2), stage=nn.Tanh())))
    with pytest.raises(ValueError, match=r"named `gather`, a name the pipeline uses for an attribute of its own"):
        GPipe(nn.Sequential(OrderedDict(gather=nn.Linear(2, 2))))
    with pytest.raises(ValueError, match=r"named `elsewhere`, a name the pipeline uses .*a stage copy's"):
        GPipe(nn.Sequential(OrderedDict(embed=nn.Linear(2, 2), elsewhere=nn.Tanh())))  # a StageCopy's attribute
    pipe = GPipe(_named(), chunks=2)  # what the list must hold: every attribute a built pipe set beyond nn.Module's
    assert set(vars(pipe)) - set(vars(nn.Module())) - set(_CALL_HOOKS) <= OWN_ATTRIBUTES
    copy = StageCopy(_named(), [2, 1], 0, lambda obj, to_all=True: [obj])  # and a weight average's stage copy
    assert set(vars(copy)) - set(vars(nn.Module())) <= OWN_ATTRIBUTES


def test_a_guard_left_by_a_pipeline_that_never_closed_is_dropped_by_the_next_pipeline_of_the_sequential():
    sequential = nn.Sequential(nn.Linear(2, 2))
    sequential.register_forward_pre_hook(_called_aside, prepend=True)  # as a failed pipeline of 2 stages leaves it
    with pytest.raises(RuntimeError, match="The backbone's nn.Sequential was called directly"):
        sequential(torch.zeros(1, 2))
    GPipe(sequential).close()  # one process: no guard of its own
    torch.testing.assert_close(sequential(torch.zeros(1, 2)), sequential[0](torch.zeros(1, 2)))


def test_a_first_training_batch_smaller_than_chunks_warns_once_naming_the_fix():
    # it was cut into one micro-batch per sample without a word: a chunks set too high for the batch size went unseen
    pipe = GPipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), chunks=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            pipe(torch.randn(1, 3))  # an evaluation batch of 1 (a sanity check): cut per sample, as expected
        for size in (2, 2, 8):
            pipe(torch.randn(size, 3)).sum().backward()
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("The first training batch has 2 samples, fewer than chunks=4")
    assert "set chunks to at most 2" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GPipe(nn.Sequential(nn.Linear(3, 3)), chunks=4)(torch.randn(4, 3)).sum().backward()  # a full batch: silent


def test_the_watchdog_check_of_a_pipe_still_being_built_finds_nothing_instead_of_killing_the_watchdog():
    # GPipe.__init__ starts its failure board's watchdog before the stage runner exists; the watchdog's
    # check must not raise then (an AttributeError ended the watchdog thread, and with it failure detection).
    from torch import nn

    from lightning_gpipe import GPipe

    half_built = GPipe.__new__(GPipe)
    nn.Module.__init__(half_built)
    assert half_built.idle_stray(0.0) is None


def test_the_fingerprint_of_weights_tells_apart_one_ulp_a_shape_and_a_dtype_and_equals_on_equal_weights():
    # what start_from_rank_zero compares over the processes
    from lightning_gpipe.engine.microbatch import fingerprint as weights_digest

    weights = [torch.randn(3, 4), torch.tensor(2.0), torch.zeros(0), torch.ones(3, dtype=torch.bfloat16)]
    same = [w.clone() for w in weights]
    assert weights_digest(same) == weights_digest(weights)
    nudged = [w.clone() for w in weights]
    nudged[0][1, 2] = torch.nextafter(nudged[0][1, 2], torch.tensor(float("inf")))
    assert weights_digest(nudged) != weights_digest(weights)
    assert weights_digest([torch.ones(2, 3)]) != weights_digest([torch.ones(3, 2)])
    assert weights_digest([torch.ones(2)]) != weights_digest([torch.ones(2, dtype=torch.float64)])
    assert weights_digest([torch.ones(4, 4).t()]) == weights_digest([torch.ones(4, 4).t().contiguous()])


def test_a_call_whose_output_is_never_back_propagated_stops_counting_as_open_once_autograd_frees_it():
    # "no call under way" arms the check for peers' stray messages (GPipe.idle_stray); a detached backbone output
    # (a linear probe) never drains, and must not leave that check off for the rest of the run
    pipe = GPipe(_deep(), chunks=2)
    out = pipe(torch.randn(4, 64))
    assert pipe.runner.open_calls == 1
    features = out.detach()
    del out
    assert pipe.runner.open_calls == 0 and features.shape == (4, 64)
    pipe(torch.randn(4, 64)).sum().backward()
    assert pipe.runner.open_calls == 0
    with torch.no_grad():
        pipe(torch.randn(4, 64))
    assert pipe.runner.open_calls == 0


def test_input_gradients_join_to_none_where_no_micro_batch_got_one_and_to_zeros_where_some_did_not():
    from lightning_gpipe.engine.stage import _join

    assert _join((None, None), [2, 3]) is None  # the layer before the backbone gets no gradient, as on one device
    got = torch.ones(2, 4)
    joined = _join((got, None), [2, 3])
    assert joined.shape == (5, 4) and torch.equal(joined[:2], got) and not joined[2:].any()


def test_sync_batch_norm_inside_a_layer_is_refused_for_several_stages_naming_it_and_kept_for_one():
    from lightning_gpipe.engine.pipe import refuse_sync_batch_norm

    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    backbone = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 4), block))
    with pytest.raises(ValueError, match=r"Layer 1 \(Sequential\) of the backbone holds an nn.SyncBatchNorm \(`1`\)"):
        refuse_sync_batch_norm(backbone, 2)
    refuse_sync_batch_norm(backbone, 1)  # one stage: plain data parallelism, where SyncBatchNorm is what it is for


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"timeout": -1}, ValueError, r"`timeout` must be a positive number of seconds, got -1"),
        ({"timeout": "5"}, ValueError, r"`timeout` must be a positive number of seconds, got '5'"),
        ({"seed": "x"}, TypeError, r"`seed` must be an integer"),
    ],
)
def test_gpipe_checks_its_timeout_and_seed_at_construction(kwargs, error, message):
    # both were accepted: a string timeout failed at the first message, a string seed at the first random draw
    with pytest.raises(error, match=message):
        GPipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), **kwargs)


FORGETS_CLOSE = """
import torch, torch.distributed as dist, torch.nn as nn
from lightning_gpipe import GPipe
dist.init_process_group("gloo")
torch.manual_seed(0)
pipe = GPipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), balance=[2, 2], chunks=2)
for _ in range(2):
    pipe(torch.randn(4, 8)).sum().backward()
print("trained on rank", dist.get_rank(), flush=True)
"""


def test_a_plain_pipeline_left_open_is_closed_at_exit_instead_of_aborting_the_process(tmp_path):
    # a script that forgot pipe.close() (and dist.destroy_process_group()) trained right, then gloo aborted it at
    # exit: "terminate called without an active exception", exit -6 (3 of 3 runs in an outside tester's script)
    script = tmp_path / "forgets_close.py"
    script.write_text(FORGETS_CLOSE)
    out = run_script("-m", "torch.distributed.run", "--nproc-per-node=2", str(script), timeout=120, OMP_NUM_THREADS="1")
    assert "trained on rank 0" in out and "trained on rank 1" in out  # run_script: every process exited 0
    assert "terminate called" not in out
