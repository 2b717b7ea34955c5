"""Shared fixtures: the multi-process sweeps run once per K and are read by many tests."""

from __future__ import annotations

import os
from typing import Any, Callable

import _sweeps
import pytest

from lightning_gpipe.launch import run_ok


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gpipe"))
    os.environ["GPIPE_TEST_TMP"] = path  # spawned workers inherit it
    return path


@pytest.fixture(scope="session")
def pipeline_runs(session_tmp) -> Callable[[int], list[dict[str, Any]]]:
    """``pipeline_runs(K)``: every rank's results of the K-stage sweep (run on first use, then cached)."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def get(stages: int) -> list[dict[str, Any]]:
        if stages not in cache:
            configs = _sweeps.matrix() + _sweeps.EXTRAS + [_sweeps.DROPOUT]
            cache[stages] = run_ok(_sweeps.sweep, stages, configs, stages == 2, timeout=600)
        return cache[stages]

    return get


@pytest.fixture(scope="session")
def reference_run() -> Callable[[_sweeps.Config], dict[str, Any]]:
    """``reference_run(config)``: the same training on one device without this package (cached)."""
    cache: dict[tuple, dict[str, Any]] = {}

    def get(config: _sweeps.Config) -> dict[str, Any]:
        key = config.reference_key()
        if key not in cache:
            cache[key] = _sweeps.reference(config)
        return cache[key]

    return get
