"""The ``lightning-gpipe`` command: LightningCLI over the tasks, pipelined by config.

    lightning-gpipe fit --config configs/amoebanet_digits.yaml
    lightning-gpipe fit --config configs/unet_shapes.yaml
    lightning-gpipe plan --config configs/amoebanet_digits.yaml --devices 1 2 4 8 --memory 16GiB

``plan`` trains nothing: it builds the config's model and data, profiles the backbone here on the first
training batch, and prints the planner's predictions (samples/s, bubble, peak memory per device) for
each device count, chunks and checkpoint mode, the choice marked; ``--out`` writes them as JSON.

``fit`` trains, then tests the trained model (``--test_after_fit false`` skips that). A config names
its model and data classes with ``class_path`` (any LightningModule and LightningDataModule); without
one they are :class:`~lightning_gpipe.tasks.AmoebaNetClassifier` and
:class:`~lightning_gpipe.tasks.ImageDataModule`. The data decides the model's ``num_classes`` and
``in_channels`` where it has them (a data module without ``num_classes``, such as
:class:`~lightning_gpipe.tasks.ShapesDataModule`, leaves the model's as configured). The configs add
:class:`~lightning_gpipe.PipelineMonitor`, whose per-stage table closes ``fit``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from typing import Any, Callable, Optional

import lightning as L
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_gpipe  # noqa: F401  (registers strategy="gpipe")
from lightning_gpipe import refusals
from lightning_gpipe.balancing import backbone_sample
from lightning_gpipe.balancing.plan import (
    LinkModel,
    chunk_grid,
    micro_batch_sizes,
    plan,
    plan_table,
    profile_for_plan,
)
from lightning_gpipe.balancing.plan.auto import parse_bytes as auto_bytes
from lightning_gpipe.engine import microbatch
from lightning_gpipe.tasks import AmoebaNetClassifier, ImageDataModule

__all__ = ["GPipeCLI", "main", "plan_command", "run"]


#: The classes of ``model`` and ``data`` where a config names none: the image classification task.
DEFAULT_CLASSES = {
    "model": f"{AmoebaNetClassifier.__module__}.{AmoebaNetClassifier.__qualname__}",
    "data": f"{ImageDataModule.__module__}.{ImageDataModule.__qualname__}",
}


def _same_class(value: Any, path: str) -> bool:
    """Whether a parsed subclass value names the class at ``path`` (jsonargparse may name it by a shorter import)."""
    chosen = getattr(value, "class_path", None)
    if chosen is None or chosen == path:
        return True
    module, _, name = chosen.rpartition(".")
    default_module, _, default_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) is getattr(
            importlib.import_module(default_module), default_name
        )
    except (ImportError, AttributeError, ValueError):
        return False


class GPipeCLI(LightningCLI):
    """LightningCLI whose ``fit`` also tests, and whose data sets the model's classes and input channels."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._defaulted_parsers: list[LightningArgumentParser] = []  # one per subcommand (add_arguments_to_parser)
        super().__init__(*args, **kwargs)  # builds the parsers, parses, and runs the subcommand

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The image classification task unless a config names other classes; a config's `model:` without a
        # class_path gives the default class its arguments (jsonargparse merges them into the default).
        parser.set_defaults({key: {"class_path": path} for key, path in DEFAULT_CLASSES.items()})
        self._defaulted_parsers.append(parser)
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

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse; where the config names a class of its own for ``model`` or ``data``, parse again without the default
        class there.

        jsonargparse keeps the arguments of a subclass value whose ``class_path`` changes where the new class takes
        them too (on purpose: a command-line override of the class keeps the shared settings). From the default
        class, that handed its defaults on: a DataModule of the user's with ``batch_size: int = 8`` trained with
        ``ImageDataModule``'s 64, silently (and a model's ``lr`` would take ``AmoebaNetClassifier``'s).
        """
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        own = [key for key, path in DEFAULT_CLASSES.items() if not _same_class(config.get(key), path)]
        if not own:
            return
        for defaulted in self._defaulted_parsers:
            defaulted.set_defaults({key: None for key in own})
        super().parse_arguments(parser, args)

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


def _argument(text: str, convert: Callable[[str], Any], kind: str, valid: Callable[[Any], bool], need: str) -> Any:
    """``convert(text)`` for argparse, where ``valid`` of it; else argparse's usage error naming the value (``kind``:
    what a value that does not convert is not; empty: the converter's own message)."""
    try:
        value = convert(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}" if kind else str(error)) from None
    if not valid(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be {need}")
    return value


def parse_bytes(text: str) -> float:
    """``"16GiB"``, ``"512MB"``, ``"1e9"``: a positive number of bytes, for argparse (see
    :func:`~.plan.auto.parse_bytes`)."""
    return float(_argument(text, auto_bytes, "", lambda n: n > 0, "more than 0 bytes"))


def positive_int(text: str) -> int:
    """A whole number of at least 1, for argparse: 0 stages, micro-batches, threads, sweeps or rows mean nothing."""
    return int(_argument(text, int, "a whole number", lambda n: n >= 1, "at least 1"))


def seconds(text: str) -> float:
    """A finite number of seconds of at least 0, for argparse."""
    valid = lambda s: 0 <= s < float("inf")  # noqa: E731  (NaN and infinity fail too)
    return float(_argument(text, float, "a number of seconds", valid, "a finite number of seconds, 0 or more"))


def _plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-gpipe plan",
        description="Predict step time, bubble and peak memory per device for K devices, M micro-batches and each "
        "checkpoint mode, from a profile of the config's backbone on this machine; mark the fastest that fits.",
    )
    parser.add_argument("--config", required=True, help="a `lightning-gpipe fit` config (YAML)")
    parser.add_argument("--devices", type=positive_int, nargs="+", default=[1, 2, 4, 8], help="the K to plan for")
    parser.add_argument(
        "--chunks", type=positive_int, nargs="+", help="the M to try (default: powers of 2 to the batch size)"
    )
    parser.add_argument("--memory", type=parse_bytes, help="memory per device, e.g. 16GiB (default: no cap)")
    parser.add_argument("--bandwidth", type=parse_bytes, help="bytes per second between stages (default: unlimited)")
    parser.add_argument("--latency", type=seconds, default=0.0, help="seconds per message between stages")
    parser.add_argument("--device", default="cpu", help="where to profile the layers (cpu, cuda, cuda:1)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="profiling sweeps per micro-batch size")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="CPU threads while profiling: a stage's share of the cores (default 1)",
    )
    parser.add_argument("--rows", type=positive_int, default=8, help="rows of each K's table (fastest first)")
    parser.add_argument("--out", help="write every prediction here as JSON")
    return parser


def plan_command(args: Optional[list[str]] = None) -> dict[str, Any]:
    """``lightning-gpipe plan``: see the module's docstring. Returns what ``--out`` writes."""
    import torch

    parser = _plan_parser()
    options = parser.parse_args(args)
    device = _profiling_device(parser, options.device)
    torch.set_num_threads(options.threads)  # more threads than cores, over K processes, would time contention
    for message, category in LIBRARY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=category)
    # the command line is ours (plan's), not LightningCLI's: it parses the config only
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended", category=UserWarning)
    cli = GPipeCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["--config", options.config, "--trainer.devices", "1", "--trainer.logger", "false"],
        run=False,
        save_config_callback=None,
    )
    module, data = cli.model, cli.datamodule
    strategy = cli.trainer.strategy
    name = getattr(strategy, "backbone", "backbone")
    data.prepare_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    try:
        backbone = module.get_submodule(name)
    except AttributeError:
        raise refusals.missing_backbone(module, name) from None
    sample, _ = backbone_sample(module, backbone, name, 1, (batch, "training_step", "train dataloader"))
    batch_size = microbatch.batch_size(sample)
    grid = options.chunks or chunk_grid(batch_size)
    above = sorted(m for m in grid if m > batch_size)
    if above:  # the engine cuts a batch into at most one micro-batch per sample
        print(
            f"--chunks {' '.join(map(str, above))}: more than the batch of {batch_size} samples, "
            f"planned as {batch_size}"
        )
    model = profile_for_plan(backbone, sample, micro_batch_sizes(batch_size, grid), device, repeats=options.repeats)
    link = LinkModel(bandwidth=options.bandwidth or float("inf"), latency=options.latency)
    report: dict[str, Any] = {"config": options.config, "batch_size": batch_size, "memory": options.memory}
    report["link"] = {"bandwidth": link.bandwidth, "latency": link.latency}
    report["plans"] = []
    for stages in options.devices:
        if stages > len(model):
            print(f"K={stages}: skipped, the backbone has only {len(model)} layers", flush=True)
            continue
        result = plan(model, stages, batch_size, link, max_memory=options.memory, chunks=grid, search=True)
        choice = result.choice if result.fitting else None
        print(f"\nK={stages} (a batch of {batch_size}):\n{plan_table(result, options.rows)}", flush=True)
        if choice is None:  # what the strategy would refuse with, under the same cap
            print(f"K={stages}: nothing fits. {result.nothing_fits('--memory ')}", flush=True)
        report["plans"].append(
            {
                "stages": stages,
                "choice": None if choice is None else _row(choice),
                "candidates": [{**_row(c), "fits": result.fits(c)} for c in result.candidates],
            }
        )
    if options.out:
        with open(options.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {options.out}")
    return report


def _profiling_device(parser: argparse.ArgumentParser, name: str) -> Any:
    """``--device`` as a torch device this machine has; otherwise argparse's usage error, before any profiling."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as error:
        parser.error(f"argument --device: {name!r} is not a torch device ({error}); give cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {name!r}, but this machine has no usable CUDA device; profile on cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"argument --device: {name!r}, but this machine has {torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: {name!r}: the planner profiles on cpu or cuda")
    return device


def _row(candidate: Any) -> dict[str, Any]:
    p = candidate.prediction
    return {
        "chunks": candidate.chunks,
        "checkpoint": candidate.checkpoint,
        "balance": list(candidate.balance),
        "step_s": p.step,
        "samples_per_s": candidate.samples_per_second,
        "bubble": p.bubble,
        "peak_memory_bytes": p.peak_memory,
        "stages": [
            {"busy_s": s.busy, "idle_s": s.idle, "utilization": s.utilization, "peak_memory_bytes": s.peak_memory}
            for s in p.stages
        ],
    }


def main() -> None:
    """The ``lightning-gpipe`` console script: ``plan`` here, every other subcommand LightningCLI's."""
    if sys.argv[1:2] == ["plan"]:
        report = plan_command(sys.argv[2:])
        if report["plans"] and all(p["choice"] is None for p in report["plans"]):
            sys.exit(1)  # no K planned has a setting that fits --memory (each said so)
        return
    if sys.argv[1:2] in (["-h"], ["--help"]):  # LightningCLI's help lists its own subcommands only
        print(
            "lightning-gpipe plan --config CONFIG [--devices K ...] ...: predict step time, bubble and memory per "
            "K, M and checkpoint mode (see `lightning-gpipe plan --help`).\nThe other subcommands are "
            "LightningCLI's:\n",
            flush=True,
        )
    run()


if __name__ == "__main__":
    main()
