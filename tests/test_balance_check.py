"""The balance check: the profiled split against the stages' compute measured in training steps."""

from __future__ import annotations

import pytest

from lightning_gpipe.balancing.check import TOLERANCE, ComputeTally, compare


def test_a_measurement_that_agrees_with_the_profile_passes():
    check = compare([1.0] * 6, [3, 3], [0.30, 0.31], steps=4)
    assert not check.wrong and check.suggested == [3, 3]
    assert check.predicted == [0.5, 0.5] and check.measured[1] == pytest.approx(0.31 / 0.61)
    assert "holds" in check.message() and "over 4 training steps" in check.message()


def test_a_stage_measured_at_one_and_a_half_times_its_share_is_named_with_a_better_split():
    # stage 1 took 1.5x its predicted half: its layers cost 1.5x what the profile said
    check = compare([1.0] * 8, [4, 4], [1.0, 1.5])
    assert check.wrong and check.measured_imbalance == pytest.approx(1.2) and check.predicted_imbalance == 1.0
    # scaled costs: four layers of 0.8, four of 1.2 (shares 0.4 and 0.6 over 0.5): the best split moves a layer
    assert check.suggested == [5, 3]
    message = check.message()
    assert "the profile was wrong" in message and "stage 1 computed 60.0%" in message and "balance=[5, 3]" in message
    assert "| 1 | 4-7 | 50.0% | 60.0% |" in message


def test_an_imbalance_the_profile_predicted_is_not_an_error():
    # layers of unequal cost that no split evens out: the prediction already says 2:1, and it is measured
    check = compare([2.0, 1.0], [1, 1], [2.1, 1.0])
    assert check.predicted_imbalance == pytest.approx(4 / 3) and not check.wrong
    assert compare([2.0, 1.0], [1, 1], [2.0, 1.0 * (1 - TOLERANCE) / 2]).wrong


def test_a_check_needs_one_time_per_stage_and_one_cost_per_layer():
    with pytest.raises(ValueError, match=r"one measured time per stage of \[2, 2\]"):
        compare([1.0] * 4, [2, 2], [1.0])


def test_the_tally_counts_training_compute_passes_and_passes_every_report_on():
    import torch

    seen = []

    class Inner:
        def start(self, kind):
            return kind

        def stop(self, kind, micro, token):
            seen.append((kind, micro, token))

    tally = ComputeTally(torch.device("cpu"), Inner())
    for kind in ("forward", "wait", "backward"):
        token = tally.start(kind)
        tally.stop(kind, 0, token)
    tally.paused = True
    tally.stop("forward", 1, tally.start("forward"))
    assert [k for k, _, _ in seen] == ["forward", "wait", "backward", "forward"]
    assert all(token == kind for kind, _, token in seen)
    counted = tally.seconds()
    assert 0 < counted < 1
    tally.paused = False
    token = tally.start("forward")
    sum(range(200_000))
    tally.stop("forward", 2, token)
    assert tally.seconds() > counted


def test_in_training_a_wrong_profile_is_logged_naming_the_stage_and_a_right_one_holds():
    from _balance_check_workers import SLOW, balance_checks

    from lightning_gpipe.launch import run_ok

    results = run_ok(balance_checks, 2, timeout=300)
    for rank, result in enumerate(results):  # every rank holds the same verdict
        wrong, right, given = result["wrong"], result["right"], result["given"]
        assert wrong["check"] is not None and right["check"] is not None and given["check"] is None
        slow_stage = 0 if SLOW < wrong["check"]["balance"][0] else 1
        assert wrong["check"]["wrong"] and f"stage {slow_stage} computed" in wrong["check"]["message"]
        assert wrong["check"]["measured"][slow_stage] > wrong["check"]["predicted"][slow_stage] * (1 + TOLERANCE)
        assert wrong["check"]["suggested"] != wrong["check"]["balance"]
        assert not right["check"]["wrong"], right["check"]["message"]
        # the warning is logged on rank 0 only; the verdict is on every rank
        assert len(wrong["warnings"]) == (1 if rank == 0 else 0) and not right["warnings"]
        assert result["same_weights"]  # the check only measures: the same split given trains the same weights
