"""The strategy's checkpoints and data position: whole-model state by name, any split, exact resume.

Lightning writes what the strategy hands it: here the model's and the optimizers' state gathered
from every stage under the original parameter names (or, sharded, each stage's own part), plus the
pipeline's random-stream position and the training loader's position in its epoch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gpipe import optim_state, state, tied
from lightning_gpipe._lightning import optimizers_to_device, silence_not_resumable_warning
from lightning_gpipe.checkpoint import atomic_write, is_sharded, load_sharded, save_sharded, sharded_model_keys
from lightning_gpipe.pipe import GPipe
from lightning_gpipe.resumable import RandomState, resumable

__all__ = ["PipelineCheckpoints"]


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the user's



class PipelineCheckpoints:
    """Mixed into :class:`~lightning_gpipe.GPipeStrategy`, which provides the attributes annotated here."""

    pipe: Optional[GPipe]
    backbone: str
    state_dict_type: str
    root_device: torch.device
    optimizers: list[Any]
    checkpoint_io: Any
    is_global_zero: bool
    layout: Any
    _full_names: list[str]
    _layouts: list[optim_state.Layout]
    _loaders: list[Any]
    _loader_position: Optional[dict[str, Any]]
    _batch_idx: int
    failed: bool
    _saved_model_keys: Optional[list[str]] = None  # a sharded checkpoint's model keys (each stage reads its own)

    # -- data ------------------------------------------------------------------------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Make the training loader resumable mid-epoch (see :mod:`lightning_gpipe.resumable`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, torch.utils.data.DataLoader):
            return dataloader
        loader = resumable(dataloader, consumed=lambda: self._batch_idx + 1, random=RandomState(self.root_device))
        if self._loader_position is not None and hasattr(loader, "restore"):
            loader.restore(self._loader_position)
            self._loader_position = None
        self._loaders = [loader]
        return loader

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_idx = batch_idx
        for loader in self._loaders:
            if getattr(loader, "pending_random_state", None) is not None:  # resumed mid-epoch: go on as if never stopped
                loader._random.set(loader.pending_random_state)
                loader.pending_random_state = None

    # -- checkpoints -------------------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # restore into the partitioned model: each stage loads only the entries of its own layers
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state_dict under its original keys, on the first stage; collective.

        With ``state_dict_type="sharded"`` every stage keeps its own part; the checkpoint writer stores it.
        """
        module = self.lightning_module
        assert module is not None
        local = module.state_dict()
        if self.pipe is None or self.pipe.group is None or self.state_dict_type == "sharded" or self.failed:
            return local  # after a failure nothing is gathered: save_checkpoint writes nothing then
        full_backbone = state.gather_state_dict(self.pipe)
        return local if full_backbone is None else state.merge_backbone(local, full_backbone, self.backbone + ".")

    def _optimizer_layout(self, optimizer: Any) -> optim_state.Layout:
        names = optim_state.param_names(_unwrap(optimizer), self.lightning_module)
        everyone = state.gather_objects(self.pipe, names, to_all=True) if self.pipe is not None else [names]
        return optim_state.layout(everyone, self._full_names)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state for the whole model, numbered as on one device, on the first stage; collective."""
        optimizer = _unwrap(optimizer)
        if self.pipe is None or self.lightning_module is None or self.failed:
            return optimizer.state_dict()
        named = optim_state.named_state(optimizer, self.lightning_module)
        if self.state_dict_type == "sharded":
            return named
        parts = state.gather_objects(self.pipe, named, to_all=False)
        if parts is None:
            return {}
        return optim_state.merge(parts, self._layouts[self.optimizers.index(optimizer)])

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each stage takes its parameters' state, by name, from a checkpoint of any split or of one device."""
        module = self.lightning_module
        for optimizer, saved, layout in zip(self.optimizers, checkpoint["optimizer_states"], self._layouts):
            optimizer = _unwrap(optimizer)
            if "groups" in saved:  # a sharded checkpoint keeps the named form
                saved = optim_state.from_named(saved)
            optimizer.load_state_dict(optim_state.localize(saved, optimizer, module, layout))
        optimizers_to_device(self.optimizers, self.root_device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write atomically: the whole file on the first rank, or (sharded) every stage's part.

        Nothing is written once a rank has failed (``OnExceptionCheckpoint``, say): the stages may stand at
        different steps and the failed one cannot be asked, so a checkpoint would not be consistent.
        """
        if self.failed:
            rank_zero_warn(f"Not saving the checkpoint {str(filepath)!r}: a stage of the pipeline failed, and the "
                           "stages' states may not belong to the same step. Resume from the last checkpoint saved "
                           "before the failure.")
            return
        if self.pipe is not None:
            checkpoint["gpipe"] = {"calls": self.pipe.runner.calls, "seed": self.pipe.runner.seed,
                                   "chunks": self.pipe.chunks, "stages": self.layout.pipe_size,
                                   "balance": list(self.pipe.balance)}
            if self._loaders and hasattr(self._loaders[0], "position"):
                checkpoint["gpipe"]["loader"] = self._loaders[0].position()
        path = str(filepath)
        if self.state_dict_type == "sharded":
            if self.pipe is not None:  # the key order of a one-device state_dict, for `consolidate`
                keys = state.gather_objects(self.pipe, list(self.pipe.state_dict()), to_all=False)
                full = {k: None for part in keys or [] for k in part}
                checkpoint["gpipe"]["state_dict_keys"] = list(
                    state.merge_backbone(checkpoint["state_dict"], full, self.backbone + "."))
            save_sharded(checkpoint, path, writer=self.is_global_zero)
        elif self.is_global_zero:
            if "://" in path:  # a remote filesystem: leave atomicity to the CheckpointIO plugin
                self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
            else:
                atomic_write(lambda tmp: self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options), path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a full file (``weights_only=True`` unless asked otherwise) or this stage's part of a sharded one."""
        path = str(checkpoint_path)
        self._saved_model_keys = None
        if is_sharded(path):
            checkpoint = load_sharded(path, self._wanted_keys())
            order = {k: i for i, k in enumerate(checkpoint.get("gpipe", {}).get("state_dict_keys") or [])}
            self._saved_model_keys = sorted(sharded_model_keys(path), key=lambda k: order.get(k, len(order)))
        else:
            checkpoint = super().load_checkpoint(checkpoint_path,
                                                 weights_only=True if weights_only is None else weights_only)
        saved = checkpoint.get("gpipe")
        if saved is not None and self.pipe is not None:  # the random streams go on where they stopped
            self.pipe.runner.calls = saved["calls"]
            if self.seed is None:  # an explicit seed= wins (and warns), else the checkpoint's
                self.pipe.runner.seed = saved["seed"]
            self._warn_if_random_streams_change(saved)
        if saved is not None and saved.get("loader") is not None:
            self._loader_position = saved["loader"]  # for the training loader the loop makes next
            silence_not_resumable_warning()
        return checkpoint

    def _warn_if_random_streams_change(self, saved: dict[str, Any]) -> None:
        """Warn once (rank 0) when a training resume draws other dropout masks than the run it continues.

        The masks are keyed by (seed, call, micro-batch, layer): another ``chunks`` cuts other
        micro-batches, another seed draws other streams. Another K or balance changes neither.
        """
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or self.pipe is None:
            return
        changed = [f"{name}={now} (the checkpoint's: {then})"
                   for name, now, then in (("chunks", self.pipe.chunks, saved.get("chunks")),
                                           ("seed", self.pipe.runner.seed, saved.get("seed")))
                   if then is not None and now != then]
        if changed:
            rank_zero_warn(
                f"Resuming with {' and '.join(changed)}. Dropout's random streams are keyed by (seed, call, "
                "micro-batch, layer), so the random layers draw other masks and the results will differ from "
                f"an uninterrupted run. To keep them, resume with GPipeStrategy(chunks={saved.get('chunks')}) "
                "and leave `seed` unset (the checkpoint's seed is then used) or set it to "
                f"{saved.get('seed')}. A different number of stages or balance is fine.", category=UserWarning)

    def _model_keys(self) -> list[str]:
        """The whole model's ``state_dict`` keys, as one device has them (the other stages' layers included)."""
        module = self.lightning_module
        assert module is not None
        local = module.state_dict(keep_vars=True)
        if self.pipe is None:
            return list(local)
        full = dict.fromkeys(self.pipe.full_sequential().state_dict(keep_vars=True))
        return list(state.merge_backbone(local, full, self.backbone + "."))

    def _check_model_keys(self, saved_keys: list[str]) -> None:
        """Fail, on every rank alike, when the checkpoint was written for another model (``strict=True``).

        Each stage loads only its own layers' entries, so without this check a checkpoint of another
        backbone would load without complaint.
        """
        expected, saved = self._model_keys(), set(saved_keys)
        missing = [k for k in expected if k not in saved]
        unexpected = [k for k in saved_keys if k not in set(expected)]
        if missing or unexpected:
            raise RuntimeError(
                f"The checkpoint does not fit {type(self.lightning_module).__name__}: missing keys {missing}, "
                f"unexpected keys {unexpected}. Resume with the model (and backbone) the checkpoint was written "
                "for, or set `strict_loading = False` on the LightningModule to load the matching entries only.")

    def _wanted_keys(self):
        """Which entries of a sharded checkpoint this stage reads: its own layers, the rest of the model."""
        module = self.lightning_module
        assert module is not None
        model_keys = set(module.state_dict())
        param_keys = {n for n, _ in module.named_parameters()} | set(tied.canonical_names(module).values())

        def wanted(keys: tuple) -> bool:
            if keys[0] == "state_dict":
                return keys[1] in model_keys
            if keys[0] == "optimizer_states":
                return keys[2] == "groups" or (keys[2] in ("state", "group_of") and keys[3] in param_keys)
            return False

        return wanted

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        state_dict = checkpoint["state_dict"]
        if strict:
            saved_keys = getattr(self, "_saved_model_keys", None)
            self._check_model_keys(saved_keys if saved_keys is not None else list(state_dict))
        if self.pipe is not None:  # partitioned: this stage takes its layers' entries only
            state_dict = state.local_state_dict(state_dict, self.pipe, self.backbone + ".")
        module.load_state_dict(state_dict, strict=strict)
