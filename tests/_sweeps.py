"""Configurations that the Lightning tests run, and the worker that runs a list of them in K processes.

One spawn per K runs every configuration in a loop (``import torch`` costs seconds per process); the
session fixtures in ``conftest.py`` share the results between the tests that read them.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import _balance_workers
import _models as M
import lightning as L
import torch


@dataclass(frozen=True)
class Config:
    """One training run: what the model, the strategy and the Trainer get."""

    name: str
    model: tuple = ()  # Net(**dict(model))
    strategy: tuple = ()  # GPipeStrategy(**dict(strategy))
    trainer: tuple = ()  # Trainer(**dict(trainer))

    def reference_key(self) -> tuple:
        """What a one-device run needs to reproduce this one: everything but the pipeline's own settings."""
        return self.model, self.trainer


def matrix() -> list[Config]:
    """Chunks (one that does not divide the batch of 8) x checkpoint mode x optimizer."""
    return [
        Config(f"chunks={c} checkpoint={m} {o}", model=(("optimizer", o),), strategy=(("chunks", c), ("checkpoint", m)))
        for c, m, o in itertools.product([1, 2, 4, 3], ["always", "except_last", "never"], ["sgd", "adam"])
    ]


EXTRAS = [
    Config("stem before the backbone", model=(("stem", True),), strategy=(("chunks", 3),)),
    Config("norm clipping", strategy=(("chunks", 2),), trainer=(("gradient_clip_val", 0.05),)),
    Config("gradient accumulation", strategy=(("chunks", 2),), trainer=(("accumulate_grad_batches", 2),)),
    Config("explicit uneven balance", strategy=(("chunks", 2), ("balance", None))),
    Config("bf16-mixed", strategy=(("chunks", 2),), trainer=(("precision", "bf16-mixed"),)),
    Config("balance=time", model=(("stem", True),), strategy=(("chunks", 2), ("balance", "time"))),
    Config("balance=memory", strategy=(("chunks", 3), ("balance", "memory"))),
    # Every stage starts with an in-place layer (its input is a leaf); the checkpointed micro-batches' forward
    # must leave their stored inputs unwritten for the recompute.
    Config(
        "in-place layers first on every stage",
        model=(("inplace", True), ("optimizer", "adam")),
        strategy=(("chunks", 3), ("checkpoint", "except_last"), ("balance", "inplace")),
    ),
    # Stage 1 starts with a stop-gradient: stage 0 and the stem get no gradient, and their .grad must stay None
    # (AdamW would decay a zero gradient's parameter).
    Config(
        "a stop-gradient first on stage 1",
        model=(("stop_gradient", True), ("stem", True), ("optimizer", "adamw")),
        strategy=(("chunks", 3), ("balance", "inplace")),
    ),
    Config(
        "split backward with Adam and clipping",
        model=(("optimizer", "adam"),),
        strategy=(("chunks", 3), ("split_backward", True)),
        trainer=(("gradient_clip_val", 0.05),),
    ),
]

#: Dropout in the backbone and in the head, layers skipped by Python's and NumPy's draws, and layers that keep state
#: in plain attributes (a call counter, a running mean), with a sanity check's validation batch before training (the
#: layers draw and count in evaluation mode too): compared across K, not with a run without the package.
DROPOUT = Config(
    "dropout",
    model=(("dropout", 0.3), ("head_dropout", 0.2), ("host_random", True), ("python_state", True)),
    strategy=(("chunks", 2),),
    trainer=(("num_sanity_val_steps", 1), ("limit_val_batches", 1)),
)


def uneven_balance(stages: int) -> list[int]:
    """A deliberately lopsided split of the 7-layer test backbone."""
    return {1: [7], 2: [5, 2], 3: [1, 2, 4], 4: [1, 1, 4, 1]}[stages]


def run_config(config: Config, devices: int) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    strategy = dict(config.strategy)
    if "balance" in strategy and strategy["balance"] is None:
        strategy["balance"] = uneven_balance(devices)
    elif strategy.get("balance") == "inplace":
        strategy["balance"] = M.INPLACE_BALANCE[devices]
    L.seed_everything(0, verbose=False)
    model = M.Net(**dict(config.model))
    trainer = L.Trainer(strategy=GPipeStrategy(**strategy), devices=devices, **M.trainer_kwargs(**dict(config.trainer)))
    return M.fit_record(model, trainer, M.loader(), _validation(config))


def _validation(config: Config) -> Any:
    """A validation loader where the config validates (``limit_val_batches``), else none."""
    return M.loader(shuffle=False) if dict(config.trainer).get("limit_val_batches") else None


def reference(config: Config) -> dict[str, Any]:
    """The same run on one device, with Lightning's default strategy and without this package."""
    L.seed_everything(0, verbose=False)
    model = M.Net(**dict(config.model))
    trainer = L.Trainer(devices=1, **M.trainer_kwargs(**dict(config.trainer)))
    return M.fit_record(model, trainer, M.loader(), _validation(config))


def sweep(rank: int, world_size: int, configs: list[Config], extras: bool) -> dict[str, Any]:
    """Run every config on ``world_size`` stages; with ``extras``, also the checks that need processes."""
    results: dict[str, Any] = {c.name: run_config(c, world_size) for c in configs}
    if extras:
        results["predict"] = predict_after_fit(world_size)
        results["checkpoint"] = checkpoint_during_fit(world_size)
        results["too many stages"] = too_many_stages(world_size)
        results["summary"] = summary_totals(world_size)
        results["measured balance"] = _balance_workers.measured_balance(world_size)  # ends in a failed fit: last
    return results


def predict_after_fit(devices: int) -> dict[str, Any]:
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = M.Net()
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=devices, **M.trainer_kwargs())
    trainer.fit(model, M.loader())
    directory = os.path.join(tempfile.gettempdir(), f"gpipe-writers-{os.environ['MASTER_PORT']}")  # one per run
    os.makedirs(directory, exist_ok=True)
    trainer.callbacks.extend([M.Writer(directory, "epoch"), M.Writer(directory, "batch")])
    predictions = trainer.predict(model, M.loader(shuffle=False))
    return {
        "predictions": torch.cat(predictions),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "host_malloc": trainer.strategy.host_malloc,
        "written": directory,
    }


def checkpoint_during_fit(devices: int) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gpipe import GPipeStrategy

    directory = os.environ["GPIPE_TEST_TMP"]
    L.seed_everything(0, verbose=False)
    model = M.Net()
    checkpoint = ModelCheckpoint(dirpath=directory, filename="last", save_on_train_epoch_end=True)
    kwargs = M.trainer_kwargs(enable_checkpointing=True, callbacks=[checkpoint], max_steps=-1, max_epochs=1)
    trainer = L.Trainer(strategy=GPipeStrategy(chunks=2), devices=devices, **kwargs)
    trainer.fit(model, M.loader())
    return {
        "path": checkpoint.best_model_path or os.path.join(directory, "last.ckpt"),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


_SUMMARIES: list[dict[str, Any]] = []


def summary_totals(devices: int, pipeline: bool = True) -> list[dict[str, Any]]:
    """What Lightning's model summary reports (it prints on rank 0 only), down to the backbone's layers; with an
    example input that differs per rank, as an unseeded ``torch.randn`` one does."""
    import os

    from lightning.pytorch.callbacks import ModelSummary

    from lightning_gpipe import GPipeStrategy

    class Recording(ModelSummary):
        @staticmethod
        def summarize(summary_data, total_parameters, trainable_parameters, size, modes, total_flops, **kwargs):
            _SUMMARIES.append(
                {
                    "rows": dict(summary_data),
                    "total": total_parameters,
                    "trainable": trainable_parameters,
                    "modes": modes,
                    "flops": total_flops,
                }
            )

    model = M.Net()
    model.backbone[0].weight.requires_grad_(False)
    model.example_input_array = torch.full((3, M.FEATURES), float(os.environ.get("RANK", "0")))
    trainer = L.Trainer(
        strategy=GPipeStrategy() if pipeline else "auto",
        devices=devices,
        **M.trainer_kwargs(max_steps=1, enable_model_summary=True, callbacks=[Recording(max_depth=2)]),
    )
    trainer.fit(model, M.loader())
    return list(_SUMMARIES)


def too_many_stages(devices: int) -> str:
    from torch import nn

    from lightning_gpipe import GPipeStrategy

    model = M.Net()
    model.backbone = nn.Sequential(*list(model.backbone)[: devices - 1])
    trainer = L.Trainer(strategy=GPipeStrategy(), devices=devices, **M.trainer_kwargs())
    try:
        trainer.fit(model, M.loader())
    except ValueError as error:
        return str(error)
    return "no error"


class Boom(torch.nn.Module):
    """Raises in its forward on the given rank, at the given call: a stage that breaks mid-training."""

    def __init__(self, rank: int, call: int) -> None:
        super().__init__()
        self.rank, self.call, self.calls = rank, call, 0

    def forward(self, x):
        self.calls += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
        if rank == self.rank and self.calls == self.call:
            raise RuntimeError(f"boom on rank {self.rank}")
        return x


class DieAfterStep(L.Callback):
    """Ends this process with ``os._exit`` after training step 2 on ``rank``: no exception, no report."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == 2:
            os._exit(3)


def dying_fit(rank: int, world_size: int, victim: int) -> None:
    """Training where ``victim`` dies between steps, while the other ranks wait in a collective of the Trainer's
    (the per-step stop decision), not for a pipeline message. The heartbeat timeout is a minute."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2, failure_timeout=60.0),
        devices=world_size,
        **M.trainer_kwargs(max_steps=20, callbacks=[DieAfterStep(victim)]),
    )
    trainer.fit(M.Net(), M.loader())


class FailsInSetup(M.Net):
    """The module's own ``setup`` raises on one rank: before the strategy builds the pipeline."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.failing_rank = rank

    def setup(self, stage: str) -> None:
        if self.trainer.global_rank == self.failing_rank:
            raise RuntimeError(f"boom on rank {self.failing_rank}")


def failing_fit(rank: int, world_size: int, failing_rank: int, in_setup: bool = False) -> None:
    """Training where a layer at the end of stage ``failing_rank`` raises at its third call; ``in_setup``: where
    the module's ``setup`` raises there instead."""
    from lightning_gpipe import GPipeStrategy

    L.seed_everything(0, verbose=False)
    model = FailsInSetup(failing_rank) if in_setup else M.Net()
    balance = {2: [4, 3], 3: [2, 3, 2]}[world_size]
    model.backbone.insert(sum(balance[: failing_rank + 1]), Boom(failing_rank, call=3))
    balance[failing_rank] += 1
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=1, balance=balance), devices=world_size, **M.trainer_kwargs(max_steps=20)
    )
    trainer.fit(model, M.loader())
