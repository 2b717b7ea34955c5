"""Every benchmark runs end to end at a tiny size and writes the JSON its tables come from.

No timing is asserted here (timings belong to the benchmarks themselves); these tests keep the
scripts from rotting as the package changes: each one runs as a user runs it, in real processes.
"""

from __future__ import annotations

import json
import math

import pytest
from _scripts import run_script

TINY = (
    "--device cpu --amoebanet-layers 3 --amoebanet-filters 8 --image 8 --blocks 2 --width 16 --sequence 4 "
    "--unet-depth 3 --unet-convs 1 --unet-channels 4 --unet-image 16 --batch-size 8 --warmup 0 --steps 1"
).split()
MODELS = ("amoebanet", "transformer")


def _run(tmp_path, script: str, *args: str) -> tuple[str, dict]:
    path = tmp_path / f"{script}.json"
    output = run_script(f"benchmarks/{script}.py", *args, "--out", str(path), timeout=400)
    return output, json.loads(path.read_text())


def test_speed_has_a_cell_per_model_stage_count_and_micro_batch_count_beside_its_bubble_bound(tmp_path):
    models = (*MODELS, "unet")  # the U-Net: its skips go from stage to stage
    output, result = _run(
        tmp_path, "speed", *TINY, "--stages", "1", "2", "--chunks", "1", "4", "--rounds", "1", "--models", *models
    )
    cells = {(c["model"], c["stages"], c["chunks"]): c for c in result["cells"]}
    assert set(cells) == {(m, k, c) for m in models for k in (1, 2) for c in (1, 4)}
    for (model, k, m), cell in cells.items():
        assert cell["bubble_bound"] == pytest.approx(m / (m + k - 1), rel=1e-12)
        assert cell["speedup"] > 0 and math.isclose(cell["efficiency"], cell["speedup"] / k)
        assert sum(cell["balance"]) == {"amoebanet": 7, "transformer": 3, "unet": 20}[model]
        assert len(cell["balance"]) == k
    assert cells[("amoebanet", 1, 1)]["speedup"] == 1.0  # K=1 is the unit
    assert "| M | K=1 samples/s | K=2 speed-up |" in output and "GPipe's measure" in output


def test_peers_measure_every_alternative_on_the_same_model(tmp_path):
    output, result = _run(tmp_path, "peers", *TINY, "--stages", "2", "--chunks", "2", "--rounds", "1")
    variants = {
        "gpipe engine, checkpoint=never",
        "gpipe engine, checkpoint=never, split backward",
        "gpipe engine, checkpoint=except_last",
        "gpipe Trainer, checkpoint=except_last",
        "torch.distributed.pipelining ScheduleGPipe",
        "torch.distributed.pipelining Schedule1F1B",
        "one process, 1 thread",
        "one process, 2 threads",
        "Lightning DDP, 2 processes",
    }
    for model in MODELS:
        rows = {r["variant"]: r for r in result["rows"] if r["model"] == model}
        assert set(rows) == variants
        assert rows["gpipe engine, checkpoint=never"]["vs_gpipe_never"] == 1.0
        assert all(r["step_s"] > 0 and len(r["step_s_rounds"]) == 1 for r in rows.values())
        assert all(
            r["vs_one_thread_spread"][0] <= r["vs_one_thread"] <= r["vs_one_thread_spread"][1] for r in rows.values()
        )
    assert "torch.distributed.pipelining Schedule1F1B" in output


def test_trainer_sets_the_defaults_and_glibcs_own_malloc_against_one_device_beside_the_ideal(tmp_path):
    output, result = _run(
        tmp_path,
        "trainer",
        *"--image 16 --batch-size 8 --chunks 2 --warmup 0 --steps 1 --rounds 2 --balance params --malloc".split(),
    )
    rows = {r["variant"]: r for r in result["rows"]}
    assert result["ideal"] == pytest.approx(2 * 2 / 3)
    assert len(rows) == 3 and sum(r["default"] for r in rows.values()) == 1
    assert rows["GPipeStrategy(balance='params')"]["options"] == {"balance": "params"}
    assert rows["GPipeStrategy(reuse_freed_memory=False)"]["options"] == {"reuse_freed_memory": False}
    for row in rows.values():  # one speed-up per round, each against that round's one-device step
        assert len(row["speedup"]) == 2 == len(row["step_ms"]) == len(result["single_ms"])
        assert row["of_ideal_min"] <= row["of_ideal_median"] <= row["of_ideal_max"]
    assert "(default)" in output and "of ideal" in output


def test_memory_reports_every_mode_and_k_and_the_largest_model_under_the_cap(tmp_path):
    _, result = _run(
        tmp_path,
        "memory",
        *(
            "--device cpu --stages 1 2 --chunks 2 --batch-size 8 --amoebanet-layers 3 --amoebanet-filters 8 "
            "--image 8 --largest-filters 8 --largest-image 8 --largest-batch 4 --largest-chunks 2 --max-layers 12 "
            "--cap-mib 100000"
        ).split(),
    )
    assert {(r["stages"], r["checkpoint"]) for r in result["by_mode"]} == {
        (k, m) for k in (1, 2) for m in ("never", "except_last", "always")
    }
    assert all(len(r["peaks"]) == r["stages"] and r["peak"] == max(r["peaks"]) for r in result["by_mode"])
    rows = {(r["stages"], r["chunks"], r["checkpoint"]): r for r in result["largest"]}
    assert set(rows) == {(1, 1, "never"), (1, 2, "always"), (2, 2, "always")}  # naive-1, pipeline-1, pipeline-2
    for row in rows.values():  # a cap nothing reaches: the search walks up to its limit, and every try fits
        assert row["best"]["layers"] == 12 and all(t["fits"] for t in row["tried"])


def test_memory_grows_the_unets_units_per_level_in_its_search(tmp_path):
    output, result = _run(
        tmp_path,
        "memory",
        *(
            "--device cpu --models unet --stages 2 --chunks 2 --batch-size 8 --unet-depth 3 --unet-convs 1 "
            "--unet-channels 4 --unet-image 16 --largest-unet-channels 4 --largest-image 16 --largest-batch 4 "
            "--largest-chunks 2 --max-convs 3 --cap-mib 100000"
        ).split(),
    )
    assert {(r["model"], r["stages"], r["checkpoint"]) for r in result["by_mode"]} == {
        ("unet", 2, m) for m in ("never", "except_last", "always")
    }
    rows = {(r["stages"], r["chunks"], r["checkpoint"]): r for r in result["largest"]}
    assert set(rows) == {(1, 1, "never"), (2, 2, "always")} and {r["model"] for r in rows.values()} == {"unet"}
    for row in rows.values():  # a cap nothing reaches: B walks up to its limit, and every try fits
        assert row["best"]["convs"] == 3 and all(t["fits"] for t in row["tried"])
    assert "largest B" in output and "U-Net (B=1, C=4), depth 3" in output


def test_overhead_compares_the_trainer_with_the_bare_engine_per_model(tmp_path):
    output, result = _run(tmp_path, "overhead", *TINY, "--stages", "2", "--chunks", "2", "--repeats", "2")
    assert [r["model"] for r in result["rows"]] == list(MODELS)
    for row in result["rows"]:
        assert len(row["runs"]["engine"]) == len(row["runs"]["trainer"]) == 2
        assert math.isclose(row["overhead"], row["trainer_step_s"] / row["engine_step_s"] - 1)
        assert row["messages"] == 2 * 2 + 2 and 0 < row["fingerprint_s"] < row["checks_s"]
        assert math.isclose(row["checks_share"], row["checks_s"] / row["engine_step_s"])
    assert "Trainer over bare engine" in output and "Trust checks per step" in output


def test_balance_benchmark_compares_the_uniform_params_and_time_splits(tmp_path):
    _, result = _run(tmp_path, "balance", "--steps", "1", "--rounds", "1", "--batch-size", "8", "--chunks", "2")
    assert [r["split"] for r in result["rows"]] == ["uniform", "params", "time"]
    assert all(r["stage_compute_seconds"][0] > 0 and r["stage_compute_seconds"][1] > 0 for r in result["rows"])


def test_monitor_overhead_benchmark_measures_with_and_without_the_monitor(tmp_path):
    _, result = _run(
        tmp_path,
        "monitor_overhead",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--batch-size",
        "8",
        "--chunks",
        "2",
        "--trace-dir",
        str(tmp_path),
    )
    assert [r["log_every_n_steps"] for r in result["results"]] == [50, 1]
    assert all(r["self_cpu_fraction"] > 0 for r in result["results"])


def test_messages_benchmark_times_the_engine_and_a_plain_send_recv_loop_per_size(tmp_path):
    output, result = _run(tmp_path, "messages", "--sizes", "256", "4096", "--iterations", "5")
    assert [r["bytes"] for r in result["rows"]] == [256, 4096]
    for row in result["rows"]:
        assert row["plain_s"] > 0 and row["engine_s"] > 0
        assert math.isclose(row["overhead_s"], row["engine_s"] - row["plain_s"])
    assert "plain send/recv us" in output


def test_corun_benchmark_times_each_kind_of_work_alone_and_in_two_processes_at_once(tmp_path):
    kinds = ("stream", "amoebanet")
    output, result = _run(
        tmp_path, "corun", *TINY[2:14], "--kinds", *kinds, "--seconds", "0.05", "--rounds", "2", "--stream-mib", "1"
    )
    assert [r["kind"] for r in result["rows"]] == list(kinds)
    for row in result["rows"]:
        assert row["alone_per_s"] > 0 and row["together_per_s"] > 0
        assert row["slowdown_min"] <= row["slowdown"] <= row["slowdown_max"]
    assert "| work | alone per s | together per s (each) |" in output


def test_plan_benchmark_predicts_and_measures_each_cell_and_replays_table_2_from_a_kept_profile(tmp_path):
    tiny = [*TINY, "--stages", "1", "2", "--chunks", "1", "2", "--modes", "never", "always", "--repeats", "1"]
    tiny += ["--rounds", "2"]  # each cell measured twice, keeping its fastest
    table2 = ["--table2-layers", "6", "--table2-filters", "8", "--table2-image", "8", "--table2-batch", "32"]
    kept = str(tmp_path / "table2.pt")
    output, result = _run(tmp_path, "plan", *tiny, "--models", "amoebanet", *table2, "--table2-profile", kept)
    cells = [c for c in result["cells"] if "predicted_step_s" in c]
    assert {(c["stages"], c["chunks"], c["checkpoint"]) for c in cells} == {
        (k, m, mode) for k in (1, 2) for m in (1, 2) for mode in ("never", "always")
    }
    for c in cells:
        assert c["predicted_step_s"] > 0 and c["measured_step_s"] > 0 and len(c["measured_tensor_peaks"]) == c["stages"]
    assert [c["stages"] for c in result["cells"] if c.get("auto")] == [1, 2]
    first = result["table2"]["tables"][0]
    assert first["link"] == "ideal" and first["speedup"]["K=2 M=1"] == 1.0 and len(first["speedup"]) == 9
    assert "step time within 15%" in output and "GPipe's Table 2, predicted" in output
    # the kept profile is read back, not taken again: the same table over a slower link as well
    _, again = _run(tmp_path, "plan", "--table2-only", *table2, "--table2-profile", kept, "--table2-link", "1", "100")
    ideal, slow = again["table2"]["tables"]
    assert again["cells"] == [] and ideal["step_s"] == first["step_s"]
    assert slow["link"] == "1 GB/s, 100 us" and all(slow["step_s"][k] >= ideal["step_s"][k] for k in ideal["step_s"])


def test_profile_sum_benchmark_sets_the_summed_layer_times_beside_a_whole_pass(tmp_path):
    sizes = TINY[: TINY.index("--batch-size")]  # the workloads' sizes, no step counts
    output, result = _run(tmp_path, "profile_sum", *sizes, "--batches", "4", "--passes", "1")
    assert [c["batch"] for c in result["cells"]] == [4, 4]
    for c in result["cells"]:
        assert all(c[k] > 0 for k in ("whole_s", "host_s", "per_layer_s", "per_layer_hooked_s", "profile_s"))
    assert "profile / whole" in output


def test_split_search_benchmark_replays_and_measures_the_split_by_time_and_the_searched_split(tmp_path):
    sizes = TINY[TINY.index("--device") + 2 : TINY.index("--batch-size")]  # the sizes; it runs on the CPU
    steps = ["--image", "16", "--batch-size", "8", "--warmup", "0", "--steps", "1", "--rounds", "1", "--repeats", "1"]
    output, result = _run(tmp_path, "split_search", *sizes, *steps, "--cases", "vgg:10", "amoebanet:2")
    assert [c["case"] for c in result["cases"]] == ["vgg:10", "amoebanet:2"]
    for c in result["cases"]:
        assert sum(c["by_time"]) == sum(c["searched"]) and len(c["by_time"]) == 2
        assert all(s > 0 for s in c["predicted_s"]) and c["predicted_gain"] >= 1.0
        assert c["step_s"]["by_time"] and all(s > 0 for s in c["step_s"]["by_time"])
        assert ("searched" in c["step_s"]) == (c["by_time"] != c["searched"])
    assert "| model:frozen layers | split by time / searched |" in output


def test_split_cost_times_both_halves_of_a_split_backward_and_estimates_the_drain_from_them(tmp_path, monkeypatch):
    sizes = TINY[: TINY.index("--batch-size")]
    output, result = _run(tmp_path, "split_cost", *sizes, "--batch-size", "8", "--chunks", "2", "--passes", "1",
                          "--stages", "2", "4")  # fmt: skip
    assert [c["micro_batch"] for c in result["cells"]] == [4, 4]
    monkeypatch.syspath_prepend("benchmarks")
    split_cost = __import__("split_cost")
    for c in result["cells"]:
        assert all(c[k] > 0 for k in ("forward", "whole", "input", "weights"))
        assert c["predicted_gain"] == {str(k): split_cost.predicted_gain(c, k, 2) for k in (2, 4)}
    assert "| model (second half) | forward ms | whole backward ms | input ms | weights ms |" in output
    # the estimate on costs where it is known: no overhead, so the first stage's last input gradient comes
    # (K - 1) * (whole - input) sooner in a step of (M + K - 1) * (forward + whole)
    times = {"forward": 10.0, "whole": 10.0, "input": 5.0, "weights": 5.0}
    assert split_cost.predicted_gain(times, 2, 8) == pytest.approx(180 / 175)
    assert split_cost.predicted_gain(times, 4, 8) == pytest.approx(220 / 205)
    # a split that costs 1 more per micro-batch than the whole backward pays it M - 1 times on the drain's path
    assert split_cost.predicted_gain(times | {"weights": 6.0}, 2, 8) == pytest.approx(180 / (180 - 5 + 7))
