"""Run a script of this repository as a subprocess, as a user would, and return its output."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What Lightning's launcher leaves in os.environ after a one-process run in the test process. A script
#: that inherits them believes it is a rank that was already launched, and waits for ranks that never come.
LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "LOCAL_RANK",
    "GLOBAL_RANK",
    "WORLD_SIZE",
    "RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)


def run_script(*args: str, timeout: float = 300, **env: str) -> str:
    """``python *args`` from the repository root with this worktree's package; fails on a non-zero exit."""
    environment = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    environment.update(PYTHONPATH=ROOT, **env)
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr
