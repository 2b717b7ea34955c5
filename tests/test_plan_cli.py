"""`lightning-gpipe plan`: builds the config's model and data, profiles, prints and writes every K's plan."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from lightning_gpipe.cli import main, parse_bytes, plan_command

CONFIG = str(pathlib.Path(__file__).resolve().parent.parent / "configs" / "amoebanet_digits.yaml")


def test_plan_prints_and_writes_every_k_marks_the_fastest_that_fits_and_skips_a_k_beyond_the_layers(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--config", CONFIG, "--devices", "1", "2", "99", "--chunks", "1", "4", "--repeats", "1", "--out", str(out)]
    report = plan_command([*args, "--memory", "1GiB", "--latency", "1e-4"])
    printed = capsys.readouterr().out
    assert "K=99: skipped, the backbone has only 13 layers" in printed
    assert printed.count("| choice |") == 2 and "K=2 (a batch of 64)" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [p["stages"] for p in report["plans"]] == [1, 2] and report["link"]["latency"] == 1e-4
    for p in report["plans"]:
        fitting = [c for c in p["candidates"] if c["fits"]]
        assert p["choice"] == {k: v for k, v in fitting[0].items() if k != "fits"}
        assert p["choice"]["step_s"] == min(c["step_s"] for c in fitting)
        assert {c["chunks"] for c in p["candidates"]} == {1, 4}
        assert {c["checkpoint"] for c in p["candidates"] if c["chunks"] == 4} == {
            "always",
            "except_last",
            "keep:2",
            "keep:3",
            "never",
        }
        assert len(p["choice"]["stages"]) == p["stages"]


def test_plan_says_when_nothing_fits_the_memory_exits_1_and_names_chunks_above_the_batch(monkeypatch, capsys):
    # every row said "fits: no", with no line saying so and exit code 0; --chunks above the batch was dropped silently
    args = ["--config", CONFIG, "--devices", "1", "2", "--chunks", "1", "128", "--repeats", "1", "--memory", "1KiB"]
    monkeypatch.setattr(sys, "argv", ["lightning-gpipe", "plan", *args])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 1
    printed = capsys.readouterr().out
    assert "--chunks 128: more than the batch of 64 samples, planned as 64" in printed
    said = "nothing fits. No (chunks, checkpoint, balance) is predicted to fit in --memory 1.0 KiB per device"
    assert printed.count(said) == 2, printed[-2000:]


def test_sizes_are_read_with_units_and_a_bad_one_is_named():
    assert parse_bytes("2MiB") == 2 * 2**20
    with pytest.raises(Exception, match="'16 parsecs' is not a size"):
        parse_bytes("16 parsecs")


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--devices", "0", "argument --devices: '0' must be at least 1"),
        ("--chunks", "-2", "argument --chunks: '-2' must be at least 1"),
        ("--repeats", "0", "argument --repeats: '0' must be at least 1"),
        ("--threads", "0", "argument --threads: '0' must be at least 1"),
        ("--rows", "-1", "argument --rows: '-1' must be at least 1"),
        ("--bandwidth", "-1", "argument --bandwidth: '-1' must be more than 0 bytes"),
        ("--memory", "abc", "argument --memory: 'abc' is not a size"),
        ("--latency", "-1", "argument --latency: '-1' must be a finite number of seconds"),
        ("--device", "tpu", "argument --device: 'tpu' is not a torch device"),
    ],
)
def test_a_bad_plan_option_is_a_usage_error_naming_it_before_anything_is_built(option, value, says, capsys):
    # before: a raw traceback from deep in the planner or torch, or (repeats, rows) silently accepted
    with pytest.raises(SystemExit) as exit:
        plan_command(["--config", CONFIG, option, value])
    assert exit.value.code == 2
    assert says in capsys.readouterr().err


def test_plan_on_a_cuda_device_this_machine_lacks_is_a_usage_error(capsys):
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = f"cuda:{count}" if count else "cuda"
    says = f"this machine has {count} CUDA devices" if count else "this machine has no usable CUDA device"
    with pytest.raises(SystemExit):
        plan_command(["--config", CONFIG, "--device", device])
    assert f"argument --device: {device!r}, but {says}" in capsys.readouterr().err


def test_the_commands_help_names_plan_beside_lightning_clis_subcommands(monkeypatch, capsys):
    from lightning_gpipe import cli

    monkeypatch.setattr("sys.argv", ["lightning-gpipe", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    printed = capsys.readouterr().out
    assert "lightning-gpipe plan --config CONFIG" in printed and "{fit,validate,test,predict}" in printed
