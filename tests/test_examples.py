"""The examples run as scripts, through Lightning's own subprocess launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An in-process fit earlier in this pytest process (devices=1 goes through Lightning's subprocess launcher,
# which starts no child) leaves LOCAL_RANK, NODE_RANK, MASTER_ADDR and MASTER_PORT in os.environ. A script
# that inherits them takes itself for a launched child and waits for peers that never come.
_LAUNCH_VARIABLES = {"LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}


def run_script(*args: str, timeout: float = 300) -> str:
    env = {**{k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}, "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def test_digits_cnn_trains_over_two_processes_launched_by_lightning():
    output = run_script("examples/digits_cnn.py", "--devices", "2", "--max-epochs", "8")
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", output).group(1))
    assert accuracy > 0.9  # the README main job; a broken pipeline stays near 0.1
