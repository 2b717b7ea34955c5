"""Errors a user's layer raises inside a stage: which layer, on which stage, on which micro-batch of how many samples.

A layer runs on a micro-batch, not on the batch that one device would give it, and the error of a layer deep in a
stage names neither: torch's "Expected more than 1 value per channel when training" for a BatchNorm given a
micro-batch of one sample, where one device's whole batch has several, says nothing of the pipeline. A note
(``add_note``) keeps the error's type, so code that catches it still does; the failure board passes notes on to
the other ranks.
"""

from __future__ import annotations

from typing import Any

from lightning_gpipe.engine import microbatch

__all__ = ["note_layer_error", "one_sample_advice"]

#: torch's error for a BatchNorm given one sample in training, which a pipeline meets where one device does not
_ONE_SAMPLE = "Expected more than 1 value per channel when training"


def note_layer_error(error: BaseException, layer: str, micro: int, given: Any, why: str = "") -> None:
    """Add to ``error``, raised by ``layer`` ("Layer 3 (Linear) on stage 1") on micro-batch ``micro``, whose input
    was ``given``, which layer raised it on how many samples; ``why`` says why the layer ran, where it was not the
    forward itself."""
    try:
        count = microbatch.batch_size(given)
        size = f"{count} sample{'' if count == 1 else 's'}"
    except ValueError:
        size = "its samples"
    note = f"(raised by {layer[:1].lower()}{layer[1:]} on micro-batch {micro}, of {size}{why}: the pipeline cuts "
    note += "each batch into `chunks` micro-batches)"
    note += one_sample_advice(error)
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: kept where the failure board reads it
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]


def one_sample_advice(error: BaseException) -> str:
    """What to change where ``error`` is a BatchNorm's on a micro-batch of one sample (else ``""``)."""
    if _ONE_SAMPLE not in str(error):
        return ""
    return (
        " BatchNorm cannot train on one sample, and `chunks` cut this batch into micro-batches of one: give "
        "every batch at least 2 x chunks samples (`drop_last=True` for a short last one), or use fewer chunks."
    )
