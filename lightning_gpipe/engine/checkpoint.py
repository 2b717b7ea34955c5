"""Re-materialization (GPipe's checkpointing): which micro-batches drop their activations, and the recompute.

A checkpointed micro-batch keeps only its stage input in the forward and runs the stage again right
before its backward. This module decides which micro-batches that is (``checkpoint=`` of ``GPipe``
and ``GPipeStrategy``) and provides the context the recompute runs in. As in torchgpipe, the word
"checkpoint" means this everywhere in the package; files are in :mod:`lightning_gpipe.checkpointing`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["CHECKPOINT_MODES", "check_checkpoint_mode", "checkpointed", "is_recomputing", "recomputing"]

#: The re-materialization policies of torchgpipe, by name.
CHECKPOINT_MODES = ("always", "except_last", "never")

_local = threading.local()


def check_checkpoint_mode(mode: object) -> str:
    """``mode`` if it names a policy, else a ``ValueError`` that lists them."""
    if not isinstance(mode, str) or mode not in CHECKPOINT_MODES:
        raise ValueError(f"`checkpoint` must be one of {CHECKPOINT_MODES}, got {mode!r}.")
    return mode


def checkpointed(mode: str, micro: int, chunks: int) -> bool:
    """Whether micro-batch ``micro`` drops its activations in the forward and recomputes them in the backward.

    ``except_last`` keeps the last micro-batch: it is the first to be back-propagated, so recomputing it
    would be done at once, with nothing to overlap.

    >>> [checkpointed("except_last", i, 3) for i in range(3)]
    [True, True, False]
    """
    check_checkpoint_mode(mode)
    if mode == "always":
        return True
    if mode == "except_last":
        return micro < chunks - 1
    return False


def is_recomputing() -> bool:
    """True while a checkpointed micro-batch is being recomputed for its backward.

    A layer that changes state in its forward (a running statistic, a counter) checks this to change
    it once per micro-batch, not twice. BatchNorm's running statistics are handled by the engine.
    """
    return getattr(_local, "recomputing", False)


@contextmanager
def recomputing(stage: nn.Module) -> Iterator[None]:
    """The recompute of ``stage``: :func:`is_recomputing` is true, and BatchNorm's running statistics stay put.

    The forward already moved them once for this micro-batch; they are kept aside and put back after.
    """
    norms = [m for m in stage.modules() if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
    saved = [[b.clone() for b in m.buffers()] for m in norms]
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = False
        with torch.no_grad():
            for m, values in zip(norms, saved):
                for b, v in zip(m.buffers(), values):
                    # Through `.data`: BatchNorm's backward keeps the running statistics it was given, and a
                    # restore that bumped their version would make autograd reject the recomputed graph.
                    b.data.copy_(v)
