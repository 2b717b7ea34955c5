"""float16 mixed precision (`precision="16-mixed"`): one loss scale and one skip decision for every stage."""

from __future__ import annotations

import _grad_scaler_workers as W
import pytest
import torch

from lightning_gpipe.launch import run_ok, run_processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fp16"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPIPE_TEST_TMP", directory)
        (references,) = run_ok(W.references, 1, timeout=300)
        pipelined = run_ok(W.pipelined, 2, timeout=300)
    return references, pipelined


def _worst(got: dict, want: dict) -> float:
    assert list(got) == list(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage_as_on_one_device(runs):
    references, (first, second) = runs
    want = references["one device"]
    assert len(set(want["scales"])) > 2 and min(want["scales"]) < 2.0**16  # steps were skipped, the scale moved
    for rank in (first, second):
        got = rank["chunks=1"]
        assert got["scales"] == want["scales"]
        assert _worst(got["weights"], want["weights"]) <= 1e-6
        assert got["saved scaler"] == want["saved scaler"] is not None  # the one-device key and state
    # the infs were stage 0's alone: a scaler per stage would have stepped stage 1 and kept its scale
    assert any(first["chunks=1"]["own_infs"]) and not any(second["chunks=1"]["own_infs"])


def test_a_resume_from_the_middle_continues_with_the_saved_scale_exactly(runs):
    _, pipelined = runs
    for rank in pipelined:
        whole, resumed = rank["chunks=1"], rank["resumed"]
        assert resumed["scales"] == whole["scales"][W.STEPS // 2 :]
        assert _worst(resumed["weights"], whole["weights"]) == 0.0
        assert resumed["saved scaler"] == whole["saved scaler"]


def test_with_micro_batches_the_loss_scale_and_weights_do_not_depend_on_the_number_of_stages(runs):
    # each micro-batch's float16 gradients are rounded and can overflow on their own, so with chunks > 1 the
    # skips can differ from one device's; they do not depend on K
    references, pipelined = runs
    want = references["K=1, chunks=4"]
    for rank in pipelined:
        got = rank["chunks=4"]
        assert got["scales"] == want["scales"]
        assert _worst(got["weights"], want["weights"]) <= 1e-6


def test_a_loss_scale_changed_on_rank_zero_only_stops_every_stage_before_the_next_step(tmp_path, monkeypatch):
    monkeypatch.setenv("GPIPE_TEST_TMP", str(tmp_path))
    outcome = run_processes(W.scale_changed_on_rank_zero, 2, timeout=120)
    assert all(code is not None and code != 0 for code in outcome.exitcodes), outcome.exitcodes
    for error in outcome.errors:
        assert error.startswith("PipelineError: The pipeline's stages disagree on their optimizers before"), error
        assert "the GradScaler's (scale, growth tracker) is (" in error and "on stage 1 (rank 1)" in error


def test_a_plain_pytorch_loop_with_torchs_grad_scaler_skips_and_scales_as_one_process():
    # without Lightning: torch's own GradScaler, whose verdict joins the stages once a pipeline is built
    (want,) = run_ok(W.plain, 1, False, timeout=120)
    assert min(want["scales"]) < 2.0**16  # steps were skipped
    for got in run_ok(W.plain, 2, True, timeout=120):
        assert got["scales"] == want["scales"]
        assert got["weights"] and all(torch.equal(got["weights"][n], want["weights"][n]) for n in got["weights"])
