"""Never silently wrong, never hung: stages out of step, different batches, failures in callbacks, misuse.

Each scenario runs real processes with the default ``timeout`` (1800 s) and must end on every rank
within 60 s (process start-up included), with a message that says what went wrong.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import _models as M
import _trust_workers as W
import pytest
import torch
from _scripts import LAUNCH_VARIABLES, ROOT
from torch import nn

from lightning_gpipe import GPipe
from lightning_gpipe.launch import run_processes

BOUND = 60.0


def _assert_all_ended_with_errors(outcome):
    assert all(code is not None for code in outcome.exitcodes), f"hung ranks: {outcome.exitcodes}"
    assert all(code != 0 for code in outcome.exitcodes), outcome.exitcodes
    assert outcome.seconds < BOUND, f"took {outcome.seconds:.1f}s"
    assert all(outcome.errors), outcome.errors


@pytest.mark.parametrize(
    "hook, samples",
    [("on_train_batch_end", 8), ("on_train_epoch_end", 2)],
    ids=[
        "batch of the training size, other rank in Lightning's per-batch broadcast",
        "smaller batch, other rank in ModelCheckpoint's save",
    ],
)
def test_a_rank_zero_only_callback_that_calls_the_model_fails_every_rank_at_once(session_tmp, hook, samples):
    outcome = run_processes(W.rank_zero_callback, 2, hook, samples, timeout=120)
    _assert_all_ended_with_errors(outcome)
    # the rank that noticed says what each rank was doing and how to fix it; the other carries that report
    report = outcome.errors[1]
    assert report.startswith("PipelineError: The pipeline's stages fell out of step: stage 1"), report
    assert f"(made in `{hook}`)" in report and "@rank_zero_only" in report
    assert "stage 1 (rank 1) reported: The pipeline's stages fell out of step" in outcome.errors[0]
    assert "keep the batch in dim 0" not in outcome.errors[0] + outcome.errors[1]


def test_a_failing_stage_under_on_exception_checkpoint_ends_every_rank_with_its_error_and_writes_no_file(tmp_path):
    path = str(tmp_path / "on-exception.ckpt")
    outcome = run_processes(W.failing_stage_with_on_exception_checkpoint, 2, path, timeout=120)
    _assert_all_ended_with_errors(outcome)
    assert "boom on rank 1" in outcome.errors[1]
    assert outcome.errors[0].startswith("PipelineError: stage 1 (rank 1) failed: RuntimeError: boom on rank 1")
    assert os.listdir(tmp_path) == []  # no checkpoint, partial or temporary, at its path or beside it


def test_a_layer_of_the_last_stage_that_raises_while_stage_0_still_sends_reaches_stage_0_with_its_cause():
    # stage 0, waiting for a send buffer to come back, met the ended process's closed connection first and said only
    # "Lost the connection to stage 1 (rank 1): [...pair.cc:545] Read error ... Connection reset by peer"
    outcome = run_processes(W.last_stage_raises, 2, timeout=120)
    _assert_all_ended_with_errors(outcome)
    assert outcome.errors[1].startswith("ValueError: boom on one sample"), outcome.errors[1]
    assert outcome.errors[0].startswith("PipelineError: stage 1 (rank 1) failed: ValueError: boom on one sample"), (
        outcome.errors[0]
    )
    assert "raised by layer 3 (RaisesOnOneSample) on stage 1 on micro-batch 0" in outcome.errors[0]


def test_a_copy_of_the_backbone_updated_from_its_stage_ends_every_rank_before_the_next_step_naming_the_copy():
    # a momentum encoder's zip pairs this rank's stage with the copy's first layers: before, the stages' copies
    # parted, and every stage took the first stage's, whose later layers no stage had updated (with a warning)
    outcome = run_processes(W.momentum_encoder, 2, timeout=120)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert error.startswith("RuntimeError: Before training batch 1, `target` differed between the stages"), error
        assert "a copy of the backbone outside it" in error and "zip(self.backbone.parameters()" in error
        assert "AveragedModel(self.backbone)" in error and "devices=1" in error


def _under_the_default_launcher(tmp_path, call: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``W.<call>`` as a script under Lightning's popen launcher (it re-runs the script per rank); its seconds."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(f"""
        import signal
        import _trust_workers as W
        if __name__ == "__main__":
            W.{call}
    """)
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])  # the workers
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    return result, time.monotonic() - start


def _failed_under_the_default_launcher(tmp_path, call: str) -> subprocess.CompletedProcess:
    """:func:`_under_the_default_launcher`, which must end with exit code 1 within ``BOUND`` seconds."""
    result, seconds = _under_the_default_launcher(tmp_path, call)
    assert result.returncode == 1, result.stderr[-3000:]
    assert seconds < BOUND
    return result


def test_the_same_failure_under_the_default_subprocess_launcher_ends_the_job_with_the_error(tmp_path):
    # Lightning's popen launcher re-runs the script per rank and kills every rank once one dies
    call = f"failing_stage_with_on_exception_checkpoint(0, 2, {str(tmp_path / 'ckpt' / 'on-exception.ckpt')!r})"
    result, seconds = _under_the_default_launcher(tmp_path, call)
    assert result.returncode != 0
    assert seconds < BOUND
    assert "RuntimeError: boom on rank 1" in result.stderr
    assert not glob.glob(str(tmp_path / "ckpt" / "*"))


@pytest.mark.parametrize("status, code", [("normal", 0), ("exit 3", 3)])
def test_a_script_that_catches_a_failed_trainer_call_exits_with_its_own_status(tmp_path, status, code):
    # every rank exited 1, with no message, after a failure the script had caught: each process ends without the
    # interpreter's finalizers (receiving threads may wait on dead peers), and its status was fixed at 1
    result, seconds = _under_the_default_launcher(tmp_path, f"caught_failure({status!r})")
    assert result.returncode == code, result.stderr[-3000:]
    assert "caught on rank 0: ValueError" in result.stdout and "caught on rank 1: ValueError" in result.stdout
    assert seconds < BOUND


@pytest.mark.parametrize("ranks", ["every", "zero"])
def test_save_checkpoint_after_fit_writes_every_stage_and_on_rank_zero_alone_names_the_ended_peer(tmp_path, ranks):
    # after `fit`, `trainer.save_checkpoint(path)` was refused (the optimizers hold one stage each); under
    # `if trainer.is_global_zero:` rank 0's barrier then lost the other rank, which it said had crashed
    path = tmp_path / "after.ckpt"
    result, seconds = _under_the_default_launcher(tmp_path, f"saves_after_fit({str(path)!r}, {ranks!r})")
    assert seconds < BOUND
    saved = torch.load(path, weights_only=False)  # rank 0 writes before Lightning's barrier, in both cases
    assert set(saved["state_dict"]) == set(M.Net().state_dict())
    assert len(saved["optimizer_states"][0]["state"]) == len(list(M.Net().parameters()))  # every stage's
    if ranks == "every":
        assert result.returncode == 0, result.stderr[-3000:]
        assert "rank 0 done" in result.stdout and "rank 1 done" in result.stdout
        return
    assert result.returncode == 1, result.stderr[-3000:]
    assert "rank 1 done" in result.stdout and "rank 0 done" not in result.stdout
    assert (
        "Lost the connection to stage 1 (rank 1) during Lightning's barrier 'Trainer.save_checkpoint': it had already "
        "ended its script (rank 1: without an error), so the ranks did not make the same calls" in result.stderr
    )
    assert "`if trainer.is_global_zero:`" in result.stderr and "killed by a signal" not in result.stderr


def test_sys_exit_on_one_rank_under_the_default_launcher_ends_that_rank_with_its_code_and_the_others_naming_it(
    tmp_path,
):
    # the rank that called `sys.exit(3)` in a step exited 0 (its SystemExit left no trace for the exit handlers that
    # end a failed rank's process), so nothing said which rank ended or how
    result = _failed_under_the_default_launcher(tmp_path, "exits_on_rank_one()")
    assert re.search(r"\[lightning_gpipe\] rank 1 \(pid \d+\) ended with exit code 3", result.stderr), result.stderr[
        -3000:
    ]
    assert "stage 1 (rank 1) failed: SystemExit: 3" in result.stderr


@pytest.mark.parametrize("rank", [2, 0])
def test_a_rank_failing_in_the_last_hook_of_fit_fails_the_others_fit_and_the_job(tmp_path, rank):
    # the module's `teardown` hook, which Lightning calls after the strategy's teardown: rank 1 exited 1, rank 0 had
    # returned from `fit`, went on with its script and exited 0, and so did the job (one device exits 1). With the
    # failure on rank 0, which lives on (it waits for the ranks it started), the others' end-of-call barrier stayed
    # pending, and destroying their process groups at exit blocked until rank 0 killed them.
    result = _failed_under_the_default_launcher(tmp_path, f"fails_in_teardown_hook({rank})")
    others = [r for r in range(3) if r != rank]
    for other in others:
        expected = f"[rank{other}]: lightning_gpipe.engine.failure.PipelineError: stage {rank} (rank {rank}) failed: "
        assert expected + f"RuntimeError: the teardown hook fails on rank {rank}" in result.stderr, result.stderr[
            -3000:
        ]
    assert "fit returned on rank" not in result.stdout, result.stdout
    assert "killing the process" not in result.stderr  # every rank ended by itself


def test_a_killed_replica_is_named_by_every_rank_instead_of_gloos_connection_reset(session_tmp):
    # rank 0 waited for the replicas' gradient average on gloo's bare work: it ended with "RuntimeError: [...]
    # Read error ... Connection reset by peer" and published that as its own failure, which rank 3 then carried
    # ("stage 0 of replica 0 (rank 0) failed: RuntimeError: ..."), naming neither rank 2 nor its death
    outcome = run_processes(W.killed_replica, 4, timeout=120)
    assert outcome.exitcodes[2] == -signal.SIGKILL, outcome.exitcodes
    assert all(code == 1 for r, code in enumerate(outcome.exitcodes) if r != 2), outcome.exitcodes
    assert outcome.seconds < BOUND
    for rank in (0, 1, 3):
        error = outcome.errors[rank]
        assert "(rank 2)" in error and "rank 0) failed: RuntimeError" not in error, f"rank {rank}: {error}"
        assert not error.startswith("RuntimeError"), f"rank {rank}: {error}"


def test_a_rank_hung_in_its_own_step_under_the_default_launcher_ends_with_its_stack_instead_of_outliving_the_job(
    tmp_path,
):
    # Rank 1's check found the stages out of step and published it; rank 0 exited with the error, but rank 1, the
    # publisher, was left to end itself at its next pipeline call, which its sleeping step never made: it outlived the
    # job (a busy loop kept a core at 100%) until killed by hand, and `subprocess.run` waited on its inherited pipes
    result = _failed_under_the_default_launcher(tmp_path, f"stuck({str(tmp_path)!r})")
    assert "stage 1 has had no backbone call under way for 3s (or it has been busy that long" in result.stderr
    assert "rank 1: ending this process, 1s after a check found this rank's failure" in result.stderr
    assert "time.sleep(600)" in result.stderr  # the main thread's stack: where it hangs
    for rank in (0, 1):
        assert _ends(int((tmp_path / f"pid{rank}").read_text()), within=5.0), f"rank {rank} outlived the job"


def test_a_frozen_rank_under_the_default_launcher_is_killed_by_rank_zero_at_its_exit_instead_of_outliving_the_job(
    tmp_path,
):
    # rank 0 named the rank that stopped responding and exited, but the frozen rank (SIGSTOP) stayed stopped for good,
    # and `subprocess.run(capture_output=True)` waited on its inherited pipes: the job never ended for its caller
    result = _failed_under_the_default_launcher(tmp_path, f"stuck({str(tmp_path)!r}, frozen=True)")
    assert "PipelineError: stage 1 (rank 1) stopped responding" in result.stderr
    pid = int((tmp_path / "pid1").read_text())
    assert f"rank 0: killing the process {pid} this rank started, which has not ended 6s after" in result.stderr
    assert _ends(pid, within=5.0)


def test_a_rank_that_dies_in_native_code_prints_its_python_stack_and_the_job_ends(tmp_path):
    # a native abort (gloo's on a collective called on some ranks only) left no trace of where: the peers said only
    # that rank 1 was lost
    # and Lightning's launcher no longer kills rank 0 first (exit -9, "Child process with PID ... terminated with code
    # -6", no rank named): it says which rank died, and rank 0 ends with the error that names its stage
    result = _failed_under_the_default_launcher(tmp_path, "aborted()")
    assert re.search(r"\[lightning_gpipe\] rank 1 \(pid \d+\) ended with signal SIGABRT", result.stderr)
    assert "PipelineError: Lost the connection to stage 1 (rank 1)" in result.stderr, result.stderr[-3000:]
    assert "Fatal Python error: Aborted" in result.stderr
    assert re.search(r'File ".*_trust_workers.py", line \d+ in on_train_batch_end', result.stderr), result.stderr[
        -3000:
    ]


def _ends(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie: exited, awaiting its reaper) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.mark.parametrize("how", ["raises", "exits", "main interrupted", "worker terminated", "main terminated"])
def test_a_spawn_launch_that_fails_or_is_stopped_saves_no_untrained_model_and_ends_every_process(tmp_path, how):
    # Lightning runs `on_exception` in the main process, which is no rank: OnExceptionCheckpoint wrote its copy of the
    # model from before the run (global step 0), and its teardown raised "Net is not attached to a `Trainer`" over the
    # workers' error. A SIGINT to the main process alone left the workers training while its exit waited for them, and
    # a SIGTERM to a worker ended the workers without results, which the main process then waited for; a SIGTERM to the
    # main process killed it at once
    result, seconds = _under_the_default_launcher(tmp_path, f"spawned({str(tmp_path)!r}, {how!r})")
    assert result.returncode == (0 if how.endswith("terminated") else 1), result.stderr[-3000:]  # as one device
    assert seconds < BOUND
    assert "Not saving the checkpoint" in result.stderr and "start_method='spawn'" in result.stderr
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())
    assert "is not attached to a `Trainer`" not in result.stderr
    if how == "raises":
        assert "RuntimeError: boom on rank 1" in result.stderr
        return
    if how == "exits":  # before, the main process said only "process 1 terminated with exit code 1"
        assert "RuntimeError: rank 1 failed: SystemExit: 3" in result.stderr, result.stderr[-3000:]
        return
    for rank in (0, 1):  # every worker ended with the main process
        pid = int((tmp_path / f"pid{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("ranks", [[0, 1], [1]], ids=["every process", "stage 1 only"])
def test_sigterm_stops_every_rank_at_one_step_and_on_exception_checkpoint_saves_the_whole_model(tmp_path, ranks):
    # Lightning's handler broadcast from inside the signal handler: the job ended after 30-36 s through the deadlock
    # or out-of-step check, blaming a rank-zero-only callback, and no checkpoint was written
    directory = tmp_path / "ckpt"
    result, seconds = _under_the_default_launcher(tmp_path, f"terminated({ranks}, {str(directory)!r})")
    assert result.returncode == 0, result.stderr[-3000:]  # SIGTERMException, a SystemExit without a code: as one device
    assert seconds < BOUND
    stops = sorted(re.findall(r"rank (\d) stopped after step (\d+)", result.stdout))  # two processes, one pipe
    assert stops == [("0", "3"), ("1", "3")], result.stdout[-2000:]
    saved = torch.load(directory / "on_exception.ckpt", weights_only=False)
    assert saved["global_step"] == 3
    M.Net().load_state_dict(saved["state_dict"])  # the whole model, every stage's layers


@pytest.mark.parametrize("ranks", [[0, 1], [1]], ids=["every process (a terminal's Ctrl-C)", "stage 1 only"])
def test_ctrl_c_stops_every_rank_at_one_step_and_on_exception_checkpoint_saves_the_whole_model(tmp_path, ranks):
    # each rank raised KeyboardInterrupt where the signal found it: the job exited 1 at once, without the checkpoint
    # ("Not saving the checkpoint ...: a stage of the pipeline failed"), where one device writes it
    directory = tmp_path / "ckpt"
    result, seconds = _under_the_default_launcher(tmp_path, f"terminated({ranks}, {str(directory)!r}, signal.SIGINT)")
    assert result.returncode == 1, result.stderr[-3000:]  # Lightning's exit after a KeyboardInterrupt, as one device
    assert seconds < BOUND
    assert "Detected KeyboardInterrupt, attempting graceful shutdown" in result.stdout + result.stderr
    assert "failed" not in result.stderr, result.stderr[-3000:]
    assert "rank 0 stopped after step 3" in result.stdout, result.stdout[-2000:]  # at the signal's batch, as one device
    saved = torch.load(directory / "on_exception.ckpt", weights_only=False)
    assert saved["global_step"] == 3
    M.Net().load_state_dict(saved["state_dict"])  # the whole model, every stage's layers


def test_a_ctrl_c_after_the_last_batch_lets_the_run_finish_and_says_so():
    # noted for a stop that no later point could share: before the warning, the Ctrl-C was swallowed in silence
    outcome = run_processes(W.interrupted_after_the_last_batch, 2, timeout=BOUND)
    assert outcome.exitcodes == [0, 0], outcome.errors
    late = [m for m in outcome.results[1]["said"] if "came after the run's last batch" in m]
    assert len(late) == 1 and "Press Ctrl-C again" in late[0]
    assert not any("came after" in m for m in outcome.results[0]["said"])
    for result in outcome.results:
        assert result["steps"] == 3
        assert result["handler"] is signal.default_int_handler  # Python's own again, once the run ended


def test_sigterm_during_a_validation_stops_every_rank_at_the_next_batch_and_the_fit_resumes_from_there_exactly(
    tmp_path,
):
    # the stop waited for the validation's end (the only shared decision in it), and in a `validate` the ranks ended as
    # after a failure (exit 1), where one device stops at the next validation batch with exit 0
    directory = str(tmp_path)
    stopped = run_processes(W.terminated_in_validation, 2, directory, True, False, timeout=BOUND)
    assert stopped.exitcodes == [0, 0], stopped.errors
    for outcome in stopped.results:  # at the end of the second validation's second batch, after step 4
        assert outcome["fit"] == "SIGTERMException at step 4"
        assert outcome["validate"] == "SIGTERMException after 2 batches"
    resumed = run_processes(W.terminated_in_validation, 2, directory, False, True, timeout=BOUND)
    whole = run_processes(W.terminated_in_validation, 2, str(tmp_path / "whole"), False, False, timeout=BOUND)
    assert resumed.exitcodes == whole.exitcodes == [0, 0], resumed.errors + whole.errors
    for name, value in whole.results[0]["weights"].items():
        assert torch.equal(resumed.results[0]["weights"][name], value), name


def test_validations_of_different_lengths_end_every_rank_naming_where_each_stood():
    # with no backbone call in the validation to catch it, one rank's gather at the end of a validation batch met
    # another's stop decision: gloo aborted rank 0 (SIGABRT) and rank 1 said only that stage 0 was unreachable
    outcome = run_processes(W.validations_of_different_lengths, 2, timeout=BOUND)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert error.startswith("PipelineError: The pipeline's ranks reached different points of their loops:"), error
        assert "stage 0 (rank 0) at the end of a validation, test or predict batch" in error
        assert "stage 1 (rank 1) at a stop decision" in error


@pytest.mark.parametrize(
    "signaled, forward",
    [([0, 1], True), ([1], False)],
    ids=["every process, stage 0 in a forward pass and stage 1 at the batch's end", "stage 1 only"],
)
def test_slurms_requeue_signal_saves_one_step_of_every_stage_requeues_once_and_the_relaunch_resumes_exactly(
    tmp_path, signaled, forward
):
    # Lightning's handler saved the checkpoint from inside the signal handler, wherever it found each rank: stage 1
    # alone, or the ranks at different points, entered a collective the other did not (a gloo abort or a hang)
    directory = str(tmp_path)
    first = run_processes(W.requeued, 2, directory, signaled, forward, timeout=BOUND)
    assert first.exitcodes == [0, 0], first.errors
    saved = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)
    assert saved["global_step"] == 2  # at the end of batch 3, which steps: batch 2's gradients are not lost
    assert {int(s["step"]) for s in saved["optimizer_states"][0]["state"].values()} == {2}  # every stage's Adam
    assert len(saved["optimizer_states"][0]["state"]) == len(list(M.Net().parameters()))
    # then the validate run's signal, acted on at its end: rank 0's scontrol, once per signal
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n" * 2
    assert (tmp_path / "hpc_ckpt_2.ckpt").exists()
    if forward:
        (tmp_path / "hpc_ckpt_2.ckpt").unlink()
        relaunch = run_processes(W.requeued, 2, directory, [], False, timeout=BOUND)
        assert relaunch.exitcodes == [0, 0], relaunch.errors
        assert [r["ran"] for r in relaunch.results] == [6, 6]  # the last 6 of 10 batches: resumed from the checkpoint
        for name, value in first.results[0]["weights"].items():
            assert torch.equal(relaunch.results[1]["weights"][name], value), name


@pytest.mark.parametrize(
    "cause",
    [
        "unseeded random",
        "per-rank iterable",
        "one-pass stream",
        "unseeded text",
        "unseeded batch object",
    ],
)
def test_stages_with_different_batches_stop_at_the_first_difference_naming_the_stages_and_the_fixes(cause):
    outcome = run_processes(W.different_batches, 2, cause, timeout=120)
    _assert_all_ended_with_errors(outcome)
    report = outcome.errors[1]
    assert report.startswith("PipelineError: stage 0 (rank 0) and stage 1 hold different batches in backbone call"), (
        report
    )
    assert "(made in `training_step`)" in report and "seed_everything" in report and "IterableDataset" in report
    # the one cause of a one-pass stream, a batch the profile took on rank 0 alone, is among them with its fix
    assert "rank 0 takes the first batch at setup to profile the backbone" in report
    assert "give `balance` as a list of layers per stage" in report
    assert "stage 1 (rank 1) reported" in outcome.errors[0]


@pytest.mark.parametrize("cause, epoch", [("rate by the model's size", 0), ("rank-zero callback", 1)])
def test_stages_whose_learning_rates_differ_stop_before_the_next_step_naming_the_setting(cause, epoch):
    # each stage steps its own layers with its own optimizer: different rates went unnoticed and trained apart
    outcome = run_processes(W.different_learning_rates, 2, cause, timeout=120)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert error.startswith(
            "PipelineError: The pipeline's stages disagree on their optimizers before training batch 0 of "
            f"epoch {epoch}: SGD (optimizer 0), param group 0, lr is "
        ), error
        assert "on stage 0 (rank 0) but" in error and "on stage 1 (rank 1)" in error
        assert "ReduceLROnPlateau" in error and "@rank_zero_only" in error


@pytest.mark.parametrize(
    "when, which",
    [
        ("every step", "the training step before batch 1"),
        ("last step", "training batch 4"),
        ("nan on rank 1", "the training step before batch 1"),
    ],
)
def test_a_loss_that_depends_on_the_stage_stops_every_rank_naming_both_losses(when, which):
    # a penalty over self.parameters() adds each stage's own part: the logged loss was stage 0's part only
    outcome = run_processes(W.penalized_loss, 2, when, timeout=120)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert error.startswith(f"PipelineError: The pipeline's stages computed different losses in {which}: "), error
        assert "on stage 0 (rank 0) but" in error and "on stage 1 (rank 1)" in error
        assert "self.parameters()" in error and "weight_decay" in error
        assert "auxiliary loss" in error and "from the backbone's output" in error
        if when == "nan on rank 1":  # which one is not finite, and what that says
            assert "but nan on stage 1 (rank 1). Only nan on stage 1 is not finite: the loss overflowed" in error


def test_a_loss_that_adds_a_term_a_backbone_layer_kept_ends_every_rank_saying_how_a_pipeline_meets_a_freed_graph():
    # One device trains such a model; in a pipeline the drain has freed the layer's graph before the term's
    # backward reaches it, and torch's own error ("backward through the graph a second time") does not say why.
    outcome = run_processes(W.penalized_loss, 2, "auxiliary", timeout=120)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert "Trying to backward through the graph a second time" in error, error
        assert "a tensor that a backbone layer kept during its forward (an auxiliary loss" in error
        assert "Compute such a term from the backbone's output" in error


def test_lightnings_grad_norm_logged_in_a_pipeline_stops_every_rank_pointing_to_the_whole_model_one():
    # each rank's norms are its own stage's; the logger wrote rank 0's as the model's norms, and a smaller total
    outcome = run_processes(W.stage_grad_norms, 2, timeout=120)
    _assert_all_ended_with_errors(outcome)
    for rank, error in enumerate(outcome.errors):
        expected = f"PipelineError: Before training batch 1, rank {rank} (stage {rank}) had logged "
        assert error.startswith(expected), error
        assert "`grad_2.0_norm/" in error and "lightning_gpipe.grad_norm(self, norm_type)" in error


def test_a_second_backward_through_the_pipeline_says_what_to_do_instead():
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), chunks=2)
    loss = pipe(torch.randn(4, 4)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"second backward ran through the pipeline.*add the losses up"):
        loss.backward()


def test_a_gradient_of_a_gradient_through_the_pipeline_is_refused_naming_the_penalty_and_the_alternatives():
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), chunks=2)
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"backward with `create_graph=True` ran through the pipeline.*'ddp'"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(pipe(x).sum(), x)  # without create_graph: the input gradient, as on one device
    assert grad.shape == x.shape and grad.grad_fn is None


@pytest.mark.parametrize(
    "hook, equal",
    [("on_fit_start", False), ("on_train_start", True), ("configure_optimizers", False)],
    ids=[
        "uneven stages, which draw unequal amounts",
        "stages of equal shapes, which draw the same values",
        "drawn in configure_optimizers, which runs after the split too",
    ],
)
def test_weights_drawn_at_random_after_the_split_end_every_rank_at_the_first_step_naming_where_to_draw(hook, equal):
    # each stage drew its own layers from the stream's start: 1.05 off one device after 8 steps, without a word
    outcome = run_processes(W.drawn_after_the_split, 2, hook, equal, timeout=120)
    _assert_all_ended_with_errors(outcome)
    evidence = "changed weights now hold the very same values" if equal else "drew different amounts of random numbers"
    for error in outcome.errors:
        assert "and training batch 0, code changed the backbone's weights on stage 0 (rank 0) and stage 1" in error
        assert evidence in error and "`__init__`, `setup()` or `configure_model()`" in error, error


def test_a_stream_longer_on_one_rank_ends_every_rank_with_the_deadlock_naming_the_data_as_a_cause():
    # rank 0 ran out of batches and went to the end of the epoch while rank 1 started a sixth batch
    outcome = run_processes(W.stream_of_another_length, 2, timeout=120)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert "a deadlock" in error and "a decision of every rank (stop or go on)" in error, error
        assert "training data ran out at different batches" in error


@pytest.mark.parametrize(
    "which, what, counts",
    [
        ("training", "training batches an epoch", "5, rank 1 (stage 1): 4"),
        ("reloaded", "training batches in epoch 1, whose loaders were made anew", "5, rank 1 (stage 1): 4"),
        ("validation", "validation batches per loader", "[5], rank 1 (stage 1): [4]"),
        ("predict", "predict batches per loader", "[5], rank 1 (stage 1): [4]"),
        (
            "reloaded by replica",
            "training batches in epoch 1, whose loaders were made anew",
            "3, rank 1 (stage 1): 3, ",
        ),
    ],
    ids=["training", "training-made-anew-in-epoch-1", "validation", "predict", "replicas-made-anew-in-epoch-1"],
)
def test_loaders_of_other_lengths_on_the_stages_are_refused_before_their_loop_naming_each_ranks_count(
    which, what, counts
):
    # their batches were equal while both lasted, so the batch check had nothing to find: the ranks went on to a
    # deadlock at the shorter one's epoch end, named after failure_timeout + 5 s (47 s in the outside tester's run;
    # 35 s for loaders made anew in epoch 1, `reload_dataloaders_every_n_epochs`, which are compared before each
    # step), or, in an evaluation, to "fell out of step", which named no cause
    outcome = run_processes(W.loaders_of_other_lengths, 4 if "replica" in which else 2, which, timeout=120)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert error.startswith(f"ValueError: The ranks would run different numbers of {what} (rank 0 (stage 0): "), (
            error
        )
        assert counts in error and "distributed_sampler_kwargs" in error
    assert outcome.seconds < 30


def test_a_gradient_penalty_through_the_backbone_ends_every_rank_before_its_first_step():
    # its gradient for the backbone's weights went missing without a word: 0.71 off one device after 8 steps
    outcome = run_processes(W.penalized_loss, 2, "gradient penalty", timeout=120)
    _assert_all_ended_with_errors(outcome)
    for error in outcome.errors:
        assert "backward with `create_graph=True` ran through the pipeline" in error, error
        assert "WGAN-GP" in error and "silently miss its gradient" in error


@pytest.fixture(scope="module")
def stopped_fits():
    """The fits of ``W.stopped_fits`` on 2 stages (one spawned run), and on one device."""
    return run_processes(W.stopped_fits, 2, timeout=180), W.stopped_fits(0, 1)["stops"]


def test_a_callback_that_stops_on_rank_zero_only_stops_every_rank_where_one_device_stops(stopped_fits):
    # Lightning reads trainer.should_stop on each rank for itself: before the strategy agreed on it, rank 0
    # left the fit alone and rank 1 waited for it until the process group's timeout
    outcome, one_device = stopped_fits
    assert [r["global_step"] for r in one_device] == [8, 10, 5]  # each stop took effect where it was set
    for result in outcome.results:
        records = result["stops"]
        assert [(r["hook"], r["global_step"], r["epoch"]) for r in records] == [
            (r["hook"], r["global_step"], r["epoch"]) for r in one_device
        ]
        for got, want in zip(records, one_device):
            for name, value in want["weights"].items():
                torch.testing.assert_close(got["weights"][name], value, atol=1e-6, rtol=0)


def test_what_each_rank_would_do_its_own_way_is_refused_on_every_rank_before_any_batch(stopped_fits):
    outcome, _ = stopped_fits
    for result in outcome.results:
        # validation by each rank's own clock
        refused = result["timed validation"]
        assert refused is not None and refused.startswith("val_check_interval given as a time (5s) is not supported")
        assert "a number of training batches" in refused
        # and so is the batch size finder: each rank would search against its own out-of-memory errors
        refused = result["batch size finder"]
        assert refused is not None and refused.startswith("The batch size finder (`BatchSizeFinder`, which ")
        assert "over 2 processes" in refused and "devices=1" in refused
        # and SyncBatchNorm, which would reduce a stage's statistics with stages that do not run the layer
        refused = result["sync batchnorm"]
        assert refused is not None and refused.startswith("Trainer(sync_batchnorm=True) is not supported")
        assert "`backbone.1`" in refused and "deferred_batch_norm=True" in refused
        # and SyncBatchNorm layers the module made itself (a DDP script's convert_sync_batchnorm)
        refused = result["sync batchnorm layers"]
        assert refused is not None and refused.startswith("Layer 1 (SyncBatchNorm) of the backbone holds an nn.Sync")
        assert "the 2 stages of a pipeline" in refused and "deferred_batch_norm=True" in refused
        # and a logger's graph, which Lightning traces on rank 0 alone (only the first stage's layers run there)
        refused = result["graph logging"]
        assert refused is not None and refused.startswith("TensorBoardLogger(log_graph=True) is not supported")
        assert "log_graph=False" in refused
        # and a DistributedSampler of the user's over every process, stages included
        refused = result["sampler over the stages"]
        assert refused is not None and refused.startswith("A DataLoader's sampler is a DistributedSampler over num_r")
        assert "(here num_replicas=1, rank=0)" in refused


def test_the_modules_state_dict_during_a_pipelined_fit_refuses_and_the_ways_it_names_give_the_whole_model(
    stopped_fits,
):
    # a stage's state_dict has the whole model's keys for its own layers only: saved from rank 0, it silently
    # lost every other stage's layers
    outcome, one_device = stopped_fits
    whole_after_fit = one_device[0]["weights"]  # the same fit on one device (the weights agree to 1e-6, above)
    stage_keys = []
    for rank, result in enumerate(outcome.results):
        state = result["state at train end"]
        refused = state["refused"]
        assert refused is not None and refused.startswith("state_dict() of a backbone partitioned over 2 stages")
        assert f"stage {rank} (layers" in refused and "trainer.save_checkpoint(path)` on every rank" in refused
        assert "stage_state()" in refused
        stage_keys.append(state["stage_keys"])
        whole = {k[len("backbone.") :]: v for k, v in state["whole"].items() if k.startswith("backbone.")}
        if rank == 0:  # the strategy's state_dict, called on every rank, is the whole model on the first stage
            assert list(whole) == list(whole_after_fit)
            for name, value in whole_after_fit.items():
                torch.testing.assert_close(whole[name], value, atol=1e-6, rtol=0)
        else:  # nothing, rather than this stage's part under the whole model's keys
            assert state["whole"] == {}
    # on purpose, each stage's own part: together the whole backbone, once
    own = [{k for k in keys if k.startswith("backbone.")} for keys in stage_keys]
    assert not own[0] & own[1] and {k[len("backbone.") :] for k in own[0] | own[1]} == set(whole_after_fit)


def test_a_stop_set_on_rank_zero_only_in_the_modules_own_hook_ends_every_rank_naming_the_deadlock(tmp_path):
    # the LightningModule's on_train_batch_end runs after every callback: rank 0 leaves the fit, rank 1 waits
    # in Lightning's per-batch broadcast; found once both have waited failure_timeout (3 s here)
    outcome = run_processes(W.deadlocked, 2, "module stop", str(tmp_path / "unused.ckpt"), timeout=120)
    _assert_all_ended_with_errors(outcome)
    found = [e for e in outcome.errors if e and "none can go on (a deadlock)" in e]
    assert found, outcome.errors
    assert "stage 0 (rank 0) has waited" in found[0] and "stage 1 (rank 1) has waited" in found[0]
    assert "`trainer.should_stop` in the LightningModule's own hooks" in found[0]


def test_torchs_clip_grad_norm_on_rank_zero_only_ends_every_rank_naming_the_call(tmp_path):
    # torch's clip_grad_norm_ takes the norm of every stage in a pipeline (a collective); on rank 0 only, rank 0
    # waits in it while rank 1 has gone on: a deadlock that names the call, not a stage clipped by itself
    outcome = run_processes(W.deadlocked, 2, "rank-zero clip", str(tmp_path / "unused.ckpt"), timeout=120)
    _assert_all_ended_with_errors(outcome)
    found = [e for e in outcome.errors if e and "none can go on (a deadlock)" in e]
    assert found, outcome.errors
    assert "stage 0 (rank 0) has waited" in found[0]
    assert "for torch.nn.utils.clip_grad_norm_ (its norm over all stages)" in found[0]


def test_a_rank_zero_only_save_checkpoint_ends_the_job_naming_the_deadlock_under_the_default_launcher(tmp_path):
    # rank 0 gathers every stage's state for the file; rank 1 has gone on and waits for rank 0
    path = tmp_path / "ckpt" / "rank-zero.ckpt"
    result, seconds = _under_the_default_launcher(tmp_path, f"deadlocked(0, 2, 'rank-zero save', {str(path)!r})")
    assert result.returncode != 0
    assert seconds < BOUND
    assert "none can go on (a deadlock): " in result.stderr, result.stderr[-3000:]
    assert "a gather of every stage's state" in result.stderr and "`trainer.save_checkpoint`" in result.stderr
    assert not path.exists()


@pytest.mark.parametrize("then", ["validate", "fit"])
def test_a_rank_still_in_a_rank_zero_only_collective_when_the_next_run_starts_is_named_as_not_joined(then):
    # before: "stage 0 (rank 0) stopped responding: no heartbeat for 30s (killed, or frozen)", of a live rank 0
    # that waited in Lightning's broadcast (`trainer.log_dir` read under `if trainer.global_rank == 0`); and a new
    # Trainer's fit hung in forming its process groups, before any heartbeat (the 1800 s timeout)
    outcome = run_processes(W.rank_zero_collective_between_runs, 2, then, timeout=120)
    assert outcome.exitcodes == [1, 1] and outcome.seconds < BOUND, outcome
    if then == "validate":
        _assert_all_ended_with_errors(outcome)
        report = outcome.errors[1]
        assert "stage 0 (rank 0) stopped responding or has not joined this run: no heartbeat in the " in report, report
        assert "`trainer.log_dir`, `strategy.broadcast` or `barrier` under `if trainer.is_global_zero:`" in report
    else:
        # rank 1 waits to form the new strategy's process groups, which holds the job's store: its board finds the
        # store silent, and its watchdog ends it (printing its stack, not an exception the harness reads); rank 0's
        # broadcast then loses rank 1
        assert outcome.errors[0].startswith("PipelineError: Lost the connection to stage 1 (rank 1) during a broadcast")
