"""Skip connections across stages train exactly as on one device, and each skip crosses only its own link."""

from __future__ import annotations

import itertools

import _skip_workers as S
import pytest
import torch

from lightning_gpipe.launch import run_ok

MODES = ["always", "except_last", "never"]


def cases(stages: int) -> list[S.Case]:
    """Chunks 1, 3 (does not divide the batch of 8) and 4 x every checkpoint mode, on the skip layout of
    ``S.model``; the lopsided balance; dropout (compared with pipeline-1, which draws the same masks); the U-Net
    (depth 2) with chunks 3 and 4 in every mode, and with its dropout."""
    main, lopsided = (tuple(b) for b in S.BALANCES[stages][:2]) if stages > 1 else ((9,), (9,))
    found = [S.Case(main, c, m) for c, m in itertools.product([1, 3, 4], MODES)]
    found += [S.Case(lopsided, 3, m) for m in MODES]
    found += [S.Case(main, 3, m, dropout=0.3) for m in MODES]
    unet = tuple(S.UNET_BALANCES[stages])
    found += [S.Case(unet, c, m, unet=True) for c, m in itertools.product([3, 4], MODES)]
    found += [S.Case(unet, 3, "except_last", dropout=0.1, unet=True)]
    return found


@pytest.fixture(scope="module")
def runs():
    """Every rank's results for K = 2, 3, 4: one spawn per K."""
    return {k: run_ok(S.sweep, k, cases(k), timeout=600) for k in (2, 3, 4)}


def _assert_same(rank_results: list[dict], name: str, reference: dict, atol: float = 1e-6) -> None:
    grads, weights = {}, {}
    for results in rank_results:
        got = results[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), atol=atol, rtol=0)
        grads.update(got["grads"])
        weights.update(got["weights"])
    assert set(weights) == set(reference["weights"])  # every stage's layers, once
    for key, value in reference["grads"].items():
        torch.testing.assert_close(grads[key], value, atol=atol, rtol=0, msg=lambda m: f"{name}: grad {key}: {m}")
    for key, value in reference["weights"].items():
        torch.testing.assert_close(weights[key], value, atol=atol, rtol=0, msg=lambda m: f"{name}: weight {key}: {m}")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_skips_spanning_one_to_three_stages_and_the_unet_match_one_device_in_every_chunks_and_checkpoint_mode(
    stages, runs
):
    for case in [c for c in cases(stages) if c.dropout == 0]:
        one = S.Case((14,) if case.unet else (9,), case.chunks, case.checkpoint, unet=case.unet)
        _assert_same(runs[stages], case.name, S.reference(one))


def test_pipeline_1_with_skips_and_the_unet_matches_one_device():
    for case in [c for c in cases(1) if c.dropout == 0]:
        _assert_same([{case.name: S.pipeline(case)}], case.name, S.reference(case))


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_skips_with_dropout_draw_the_masks_of_pipeline_1(stages, runs):
    for case in [c for c in cases(stages) if c.dropout > 0]:
        whole = (14,) if case.unet else (9,)
        one = S.Case(whole, case.chunks, case.checkpoint, dropout=case.dropout, unet=case.unet)
        _assert_same(runs[stages], case.name, S.pipeline(one))
        assert (
            S.pipeline(one)["losses"]
            != S.reference(S.Case(whole, case.chunks, case.checkpoint, unet=case.unet))["losses"]
        )


def test_each_skip_crosses_only_the_link_between_its_stash_and_its_pop(runs):
    """K = 4, balance [2, 2, 2, 3], one training step of 8 samples: the payload bytes of every link, counted
    from the model's layout by hand (float32, 12 features an activation or skip, 3 logits)."""
    act, logits = 8 * S.WIDTH * 4, 8 * 3 * 4
    expected = {
        # forward: activation to the next stage, skips straight to the stage of their pop
        0: {1: act + 2 * act, 2: act, 3: act},  # to 1: activation, s1 and s6; to 2: s5; to 3: s3
        1: {2: act, 3: 2 * act, 0: act + 2 * act},  # to 3: x and s2; to 0: the input gradient, s1's and s6's
        2: {3: act, 0: act, 1: act},  # to 0: s5's gradient; to 1: the input gradient
        3: {0: logits + act, 1: logits + 2 * act, 2: logits + act},  # the shared output, then the skips' gradients
    }
    for stage, results in enumerate(runs[4]):
        assert results["bytes_sent"] == expected[stage], f"stage {stage}"


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    import _skip_lightning as SL

    return run_ok(SL.pipelined, 2, str(tmp_path_factory.mktemp("skips")), timeout=600)


def test_skips_with_deferred_batch_norm_the_monitor_and_a_re_partitioned_resume_match_one_device(lightning_runs):
    import _skip_lightning as SL

    straight = SL.one_device(SL.STEPS)
    for run in lightning_runs:
        torch.testing.assert_close(
            torch.tensor(run["first"]["losses"] + run["resumed"]["losses"]),
            torch.tensor(straight["losses"]),
            atol=1e-6,
            rtol=0,
        )
        assert set(run["resumed"]["weights"]) == set(straight["weights"])  # BatchNorm statistics included
        for key, value in straight["weights"].items():
            torch.testing.assert_close(
                run["resumed"]["weights"][key].float(), value.float(), atol=1e-6, rtol=0, msg=key
            )
    summary = lightning_runs[0]["monitor"]
    assert sorted(summary) == [0, 1] and all(summary[s]["forward"] > 0 and summary[s]["backward"] > 0 for s in summary)


def test_a_pipeline_checkpoint_with_skips_resumes_on_one_device_as_a_one_device_checkpoint_does(
    lightning_runs, tmp_path
):
    import _skip_lightning as SL

    SL.one_device(SL.FIT_STEPS, save_to=str(tmp_path))
    own = SL.one_device(SL.STEPS, ckpt_path=str(tmp_path / "skips.ckpt"))
    resumed = SL.one_device(SL.STEPS, ckpt_path=lightning_runs[0]["checkpoint"])
    assert len(resumed["losses"]) == SL.STEPS - SL.FIT_STEPS
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(own["losses"]), atol=1e-6, rtol=0)
    for key, value in own["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], value, atol=1e-6, rtol=0, msg=key)


def test_a_checkpoint_saved_after_fit_returned_holds_the_last_steps_weights_and_optimizer_state_as_saved_in_the_run(
    lightning_runs,
):
    import _skip_lightning as SL

    assert all(run["after fit"] == lightning_runs[0]["after fit"] for run in lightning_runs), "every rank saved"
    after = torch.load(lightning_runs[0]["after fit"], weights_only=False)
    in_run = torch.load(lightning_runs[0]["checkpoint"], weights_only=False)  # ModelCheckpoint at the last step
    assert after["global_step"] == in_run["global_step"] == SL.FIT_STEPS
    assert list(after["state_dict"]) == list(in_run["state_dict"])
    for key, value in in_run["state_dict"].items():
        assert torch.equal(after["state_dict"][key], value), key
    (state,), (expected,) = after["optimizer_states"], in_run["optimizer_states"]
    assert state["param_groups"] == expected["param_groups"]
    assert expected["state"] and sorted(state["state"]) == sorted(expected["state"])  # every parameter's momentum
    for index, slots in expected["state"].items():
        for slot, value in slots.items():
            assert torch.equal(torch.as_tensor(state["state"][index][slot]), torch.as_tensor(value)), (index, slot)


def test_weights_only_saved_after_fit_returned_hold_the_whole_model(lightning_runs):
    import _skip_lightning as SL

    saved = torch.load(lightning_runs[0]["weights only"], weights_only=False)
    assert "optimizer_states" not in saved
    straight = SL.one_device(SL.FIT_STEPS)["weights"]
    assert set(saved["state_dict"]) == set(straight)
    for key, value in straight.items():
        torch.testing.assert_close(saved["state_dict"][key], value, atol=1e-6, rtol=0, msg=key)


def test_skips_in_two_data_parallel_replicas_of_a_two_stage_pipeline_match_one_device(runs):
    reference = S.replicas_reference()
    for rank, results in enumerate(runs[4]):
        got = results["replicas"]
        assert got and set(got) <= set(reference), f"rank {rank}"
        for key, value in got.items():
            torch.testing.assert_close(
                value, reference[key], atol=1e-6, rtol=0, msg=lambda m: f"rank {rank} {key}: {m}"
            )
