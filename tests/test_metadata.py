"""A sharded checkpoint's metadata: JSON plus weights-only tensors, tagged values, clear errors; no pickle."""

from __future__ import annotations

import enum
import json
import os
import pathlib

import pytest
import torch

from lightning_gpipe.checkpointing.metadata import (
    JSON_FILE,
    MetadataError,
    decode,
    encode,
    load_metadata,
    save_metadata,
)


class Mode(enum.Enum):
    FAST = "fast"


def test_lightning_metadata_round_trips_with_tuples_dtypes_paths_enums_and_tensors(tmp_path):
    meta = {
        "epoch": 1,
        "global_step": 7,
        "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 2}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {
                "best_model_score": torch.tensor(0.5),
                "kth_value": float("inf"),
                "best_k_models": {},
            }
        },
        "lr_schedulers": [{"_last_lr": [0.01], "base_lrs": [0.1], "step_size": 2}],
        "hyper_parameters": {
            "betas": (0.9, 0.99),
            "dtype": torch.bfloat16,
            "root": pathlib.Path("/data"),
            "mode": Mode.FAST,
            "device": torch.device("cpu"),
            "tags": {"b", "a"},
            "raw": b"\x00\x01",
            "by_int": {3: "three"},
            "none": None,
            "nan": float("nan"),
        },
        "gpipe": {
            "calls": 4,
            "seed": 0,
            "chunks": 2,
            "balance": [3, 6],
            "loader": {"random_now": {"cpu": torch.get_rng_state()}},
        },
    }
    save_metadata(meta, str(tmp_path))
    with open(tmp_path / JSON_FILE) as f:
        json.load(f)  # plain, strict JSON (no NaN literal)
    loaded = load_metadata(str(tmp_path))
    nan = loaded["hyper_parameters"].pop("nan")
    assert nan != nan
    del meta["hyper_parameters"]["nan"]
    assert torch.equal(loaded["gpipe"]["loader"]["random_now"]["cpu"], meta["gpipe"]["loader"]["random_now"]["cpu"])
    assert loaded["callbacks"]["ModelCheckpoint{'monitor': None}"]["best_model_score"] == torch.tensor(0.5)
    for part in ("epoch", "loops", "lr_schedulers", "hyper_parameters"):
        assert loaded[part] == meta[part], part
    assert type(loaded["hyper_parameters"]["betas"]) is tuple and type(loaded["hyper_parameters"]["root"]) is type(
        pathlib.Path("/data")
    )


def test_a_value_without_an_encoding_fails_at_save_time_naming_its_key_path(tmp_path):
    with pytest.raises(MetadataError, match=r"checkpoint\['hyper_parameters'\]\['loss'\].*state_dict_type='full'"):
        save_metadata({"hyper_parameters": {"loss": torch.nn.functional.cross_entropy}}, str(tmp_path))


def test_a_user_dict_that_looks_like_a_tag_stays_a_dict():
    value = {"__gpipe__": "tensor", "v": 0}
    data, tensors = encode(value)
    assert decode(data, tensors) == value


def test_an_enum_whose_module_is_not_imported_is_refused_instead_of_imported():
    data = {"__gpipe__": "enum", "v": ["not_imported_module_xyz", "Mode", "FAST"]}
    with pytest.raises(MetadataError, match="import not_imported_module_xyz"):
        decode(data, [])


def test_the_tensor_file_is_read_with_weights_only(tmp_path, monkeypatch):
    save_metadata({"x": torch.zeros(2)}, str(tmp_path))
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k.get("weights_only")) or real_load(*a, **k))
    load_metadata(str(tmp_path))
    assert calls == [True]
    assert sorted(os.listdir(tmp_path)) == sorted([JSON_FILE, "meta_tensors.pt"])
