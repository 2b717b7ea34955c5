"""Lock-step checks: a stage gets exactly the message it expects, from a peer that holds the same batch."""

from __future__ import annotations

from lightning_gpipe.engine.failure import PipelineError
from lightning_gpipe.engine.messages import Message, Tag

__all__ = ["check_message", "stray_message_error", "OUT_OF_STEP_CAUSES", "DIFFERENT_BATCH_CAUSES"]

#: Why the ranks of a pipeline stop making the same backbone calls, and what to do instead.
OUT_OF_STEP_CAUSES = (
    "Every rank of a pipeline must call the backbone the same number of times, in the same hooks and the same "
    "order, because each call runs on all of its stages. Without Lightning (`GPipe` in a script of your own): make "
    "the same calls of the pipe, forward and backward, on every process. Under Lightning, usual causes: a callback "
    "decorated with @rank_zero_only "
    "(or code under `if trainer.is_global_zero:`) that calls the model, so one rank runs the backbone alone: call "
    "the model on every rank and only log or save on rank zero; data loaders of different lengths on different "
    "ranks; a step that calls the backbone a data-dependent number of times."
)

#: Why the stages of a pipeline see different batches, and how to fix it.
DIFFERENT_BATCH_CAUSES = (
    "The stages of a pipeline must get the same batch at every step: the backbone learns from the first stage's "
    "inputs and the last stage's targets, and the layers outside it from each rank's own. Without Lightning (`GPipe` "
    "in a script of your own): give every process the same input, drawn from the same seed in the same order or "
    "broadcast from one rank. Under Lightning, usual causes: data "
    "drawn at random before the Trainer starts, in a script that never seeds (a random subset, synthetic data: "
    "call `lightning.seed_everything(seed)` first); a `worker_init_fn` or Dataset that seeds from the global rank "
    "(seed from the data-parallel replica, `trainer.strategy.distributed_sampler_kwargs['rank']`, or use "
    "`seed_everything(seed, workers=True)`, whose worker seeds the strategy takes from the replica); an "
    "IterableDataset "
    "that yields different data on each rank (shard it by data-parallel replica, "
    "`trainer.strategy.distributed_sampler_kwargs`, never by global rank); DataLoaders of different lengths, or "
    "a sampler or DataLoader built differently, on different ranks; a random transform in the Dataset after code "
    "that drew random numbers on some ranks only where the strategy cannot make the stages' random states one "
    "again before the next batches are loaded (the LightningModule's own `on_train_batch_end` or "
    "`on_train_epoch_end`, any `on_train_epoch_start`): draw there on every rank, or move the draw into a callback; "
    "a stream that can be read only once (an IterableDataset whose `__iter__` returns the same iterator every time, "
    "a generator over a pipe or socket) in the first call: with the gpipe strategy's default balance (by measured "
    "time), 'time', 'memory' or 'auto', rank 0 takes the first batch at setup to profile the backbone, which such a "
    "stream loses on rank 0 alone; give `balance` as a list of layers per stage (or 'params'), which needs no "
    "batch, or make `__iter__` start the stream anew on every call."
)


def check_message(message: Message, expected: Tag, sender: str, stage: int) -> Message:
    """``message`` if it is the one stage ``stage`` expects from ``sender``; else a :class:`PipelineError`."""
    got = message.tag
    if not got.same_step(expected):
        raise PipelineError(
            f"The pipeline's stages fell out of step: stage {stage} expected {expected.describe()} from {sender}, "
            f"but received {got.describe()}. {OUT_OF_STEP_CAUSES}"
        )
    if got.batch and expected.batch and got.batch != expected.batch:
        raise PipelineError(
            f"{sender} and stage {stage} hold different batches in {expected.call_words()}"
            + (f" (made in `{expected.label}`)" if expected.label else "")
            + f": their fingerprints (shape, dtype and checksum of every tensor) are {got.batch:#x} and "
            f"{expected.batch:#x}. {DIFFERENT_BATCH_CAUSES}"
        )
    return message


def stray_message_error(message: Message, sender: str, stage: int, situation: str) -> str:
    """The error for a message that waits untaken while stage ``stage`` is outside the pipeline (``situation``)."""
    return (
        f"The pipeline's stages fell out of step: {situation}, but {sender} sent {message.tag.describe()}, a call "
        f"that stage {stage} has not made. {OUT_OF_STEP_CAUSES}"
    )
