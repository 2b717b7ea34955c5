"""The ``lightning-gpipe`` command: LightningCLI over the tasks, pipelined by config.

    lightning-gpipe fit --config configs/amoebanet_digits.yaml
    lightning-gpipe fit --config configs/unet_shapes.yaml

``fit`` trains, then tests the trained model (``--test_after_fit false`` skips that). A config names
its model and data classes with ``class_path`` (any LightningModule and LightningDataModule); without
one they are :class:`~lightning_gpipe.tasks.AmoebaNetClassifier` and
:class:`~lightning_gpipe.tasks.ImageDataModule`. The data decides the model's ``num_classes`` and
``in_channels`` where it has them (a data module without ``num_classes``, such as
:class:`~lightning_gpipe.tasks.ShapesDataModule`, leaves the model's as configured). The configs add
:class:`~lightning_gpipe.PipelineMonitor`, whose per-stage table closes ``fit``.
"""

from __future__ import annotations

import warnings

import lightning as L
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401  (registers strategy="gpipe")
from lightning_gpipe.tasks import AmoebaNetClassifier, ImageDataModule

__all__ = ["GPipeCLI", "main", "run"]


class GPipeCLI(LightningCLI):
    """LightningCLI whose ``fit`` also tests, and whose data sets the model's classes and input channels."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The image classification task unless a config names other classes; a config's `model:` without a
        # class_path gives the default class its arguments (jsonargparse merges them into the default).
        parser.set_defaults(
            {
                "model": {"class_path": f"{AmoebaNetClassifier.__module__}.{AmoebaNetClassifier.__qualname__}"},
                "data": {"class_path": f"{ImageDataModule.__module__}.{ImageDataModule.__qualname__}"},
            }
        )
        # A link whose source attribute the data lacks is skipped (jsonargparse ignores it for a subclass source).
        parser.link_arguments(
            "data.num_classes",
            "model.init_args.num_classes" if self.subclass_mode_model else "model.num_classes",
            apply_on="instantiate",
        )
        parser.link_arguments(
            "data.in_channels",
            "model.init_args.in_channels" if self.subclass_mode_model else "model.in_channels",
            apply_on="instantiate",
        )
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="After `fit`, run `test` on the trained model (fit only)."
        )

    def after_fit(self) -> None:
        if not self.config[self.subcommand].get("test_after_fit", True) or self.trainer.interrupted:
            return
        results = self.trainer.test(self.model, datamodule=self.datamodule)
        if self.trainer.is_global_zero and results:
            metrics = ", ".join(f"{k}={v:.4f}" for k, v in sorted(results[0].items()))
            print(f"test results: {metrics}", flush=True)


#: Deprecations raised inside the libraries by their own code, which a user of this command cannot act on.
#: Each is matched by its message, so any other warning (and these, outside the command) still shows.
LIBRARY_DEPRECATIONS = (
    # Lightning 2.6's pytree helper, on every batch transfer (torch >= 2.10 deprecated LeafSpec)
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
)


def run(args: ArgsType = None) -> GPipeCLI:
    """Parse ``args`` (by default the command line), then run the subcommand; returns the CLI (its trainer...)."""
    for message, category in LIBRARY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category)
    return GPipeCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


def main() -> None:
    """The ``lightning-gpipe`` console script."""
    run()


if __name__ == "__main__":
    main()
