"""Checkpoint files and the training state they hold: model state, optimizer state, the data loader's position.

``files`` writes and reads them (atomic and durable; full or sharded; never unpickled), ``metadata``
stores a sharded checkpoint's non-tensor state as JSON, ``model_state`` gathers and splits the
model's tensors by name, ``optim_state`` does the same for optimizers, and ``resumable`` makes a
training DataLoader resume mid-epoch. Plain PyTorch; the strategy calls them from Lightning's hooks.
"""

from lightning_gpipe.checkpointing.files import consolidate, is_sharded
from lightning_gpipe.checkpointing.metadata import MetadataError

__all__ = ["MetadataError", "consolidate", "is_sharded"]
