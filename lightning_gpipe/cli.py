"""The ``lightning-gpipe`` command: LightningCLI over the image-classification task, pipelined by config.

    lightning-gpipe fit --config configs/amoebanet_digits.yaml

``fit`` trains, then tests the trained model (``--test_after_fit false`` skips that). The model is
:class:`~lightning_gpipe.tasks.AmoebaNetClassifier`, the data :class:`~lightning_gpipe.tasks.ImageDataModule`;
the data decides the model's ``num_classes`` and ``in_channels``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lightning_gpipe  # noqa: F401  (registers strategy="gpipe")
from lightning_gpipe.partition import stage_bounds
from lightning_gpipe.tasks import AmoebaNetClassifier, ImageDataModule

__all__ = ["GPipeCLI", "StageSummary", "main", "run"]


class StageSummary(Callback):
    """At the end of ``fit``, print how the backbone was split: each stage's layers and parameters.

    A minimal stand-in for a fuller per-stage monitor: it reads the strategy's pipe when training
    starts (the pipe is gone by the end of ``fit``) and needs no communication between stages.
    """

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, int, str]] = []
        self.start: Optional[float] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()
        pipe = getattr(trainer.strategy, "pipe", None)
        if pipe is None:
            self.rows = []
            return
        layers = list(pipe.full_sequential())
        self.rows = []
        for stage, (begin, end) in enumerate(stage_bounds(pipe.balance)):
            params = sum(p.numel() for layer in layers[begin:end] for p in layer.parameters())  # meta tensors count too
            kinds = ", ".join(_describe(layer) for layer in layers[begin:end])
            self.rows.append((stage, f"{begin}-{end - 1}", params, kinds))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.rows:
            return
        seconds = time.perf_counter() - self.start if self.start is not None else float("nan")
        strategy = trainer.strategy
        header = (f"Pipeline: {len(self.rows)} stages, {getattr(strategy, 'chunks', '?')} micro-batches per batch, "
                  f"checkpoint={getattr(strategy, 'checkpoint', '?')!r}, training took {seconds:.1f} s")
        lines = [header, "| stage | layers | parameters | kinds |", "|---|---|---|---|"]
        lines += [f"| {stage} | {span} | {params:,} | {kinds} |" for stage, span, params, kinds in self.rows]
        rank_zero_info("\n".join(lines))


def _describe(layer: Any) -> str:
    name = type(layer).__name__
    extra = layer.extra_repr() if hasattr(layer, "extra_repr") else ""
    return f"{name}({extra})" if name == "Cell" and extra else name


class GPipeCLI(LightningCLI):
    """LightningCLI whose ``fit`` also tests, and whose data sets the model's classes and input channels."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes" if self.subclass_mode_model
                              else "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.in_channels", "model.init_args.in_channels" if self.subclass_mode_model
                              else "model.in_channels", apply_on="instantiate")
        parser.add_argument("--test_after_fit", type=bool, default=True,
                            help="After `fit`, run `test` on the trained model (fit only).")

    def after_fit(self) -> None:
        if not self.config[self.subcommand].get("test_after_fit", True) or self.trainer.interrupted:
            return
        results = self.trainer.test(self.model, datamodule=self.datamodule)
        if self.trainer.is_global_zero and results:
            metrics = ", ".join(f"{k}={v:.4f}" for k, v in sorted(results[0].items()))
            print(f"test results: {metrics}", flush=True)


def run(args: ArgsType = None) -> GPipeCLI:
    """Parse ``args`` (by default the command line), then run the subcommand; returns the CLI (its trainer, model...)."""
    return GPipeCLI(AmoebaNetClassifier, ImageDataModule, args=args, save_config_kwargs={"overwrite": True})


def main() -> None:
    """The ``lightning-gpipe`` console script."""
    run()


if __name__ == "__main__":
    main()
