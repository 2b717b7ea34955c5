"""Choosing M, the checkpoint mode and the split: every candidate replayed, the fastest that fits kept.

The grid is small and each replay is a few thousand arithmetic operations, so the planner tries every
candidate rather than guess: chunks from 1 to the batch size (powers of two and the batch size), every
checkpoint mode that differs for that many micro-batches (``always``, ``keep:N`` for each ``N``,
``except_last``, ``never``), and per M the splits asked for (by default the optimal split by time at
that micro-batch size, from :func:`lightning_gpipe.engine.partition.balance`). With ``search=True`` (what
``balance="auto"`` asks) each M also tries the splits that :func:`faster_split` finds near those: a split
by time evens out each stage's forward plus backward, while the replay weighs the phases apart. Under a
memory cap the search also starts from the split by memory and descends through splits that fit only (the
split by time may put the two largest layers on one stage, where no M or mode fits while another split
does), and every split one move away from those found is replayed too, so that the table has a runner-up
split. A candidate fits when its largest stage's predicted peak is under the memory cap; among those that
fit the fastest step wins.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_gpipe.balancing.plan.costs import CostModel
from lightning_gpipe.balancing.plan.link import LinkModel
from lightning_gpipe.balancing.plan.replay import Prediction, simulate
from lightning_gpipe.balancing.profiling import LayerCosts
from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.partition import balance as optimal_balance

__all__ = [
    "DEFAULT_SEARCH_GAIN",
    "Candidate",
    "Plan",
    "chunk_grid",
    "checkpoint_modes",
    "faster_split",
    "plan",
    "plan_table",
    "searched_split",
]

#: A function from (the cost model, stages, micro-batch size) to a split; the default splits by time.
Splitter = Callable[[CostModel, int, float], list[int]]


def by_time(model: CostModel, stages: int, size: float) -> list[int]:
    """The optimal split by forward plus backward time at this micro-batch size."""
    return optimal_balance(model.time(size), stages)


def by_memory(model: CostModel, stages: int, size: float) -> list[int]:
    """The optimal split by each layer's state and saved activations at this micro-batch size."""
    return optimal_balance(model.memory(size), stages)


@dataclass(frozen=True)
class Candidate:
    """One (M, checkpoint mode, split) and its replayed step."""

    chunks: int
    checkpoint: str
    balance: tuple[int, ...]
    prediction: Prediction
    batch_size: int

    @property
    def samples_per_second(self) -> float:
        return self.batch_size / self.prediction.step if self.prediction.step > 0 else float("inf")

    def describe(self) -> str:
        return f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, balance={list(self.balance)}"


@dataclass(frozen=True)
class Plan:
    """Every candidate, fastest first; the choice is the fastest that fits, the runner-up the next."""

    candidates: tuple[Candidate, ...]
    max_memory: Optional[float]

    def fits(self, candidate: Candidate) -> bool:
        return self.max_memory is None or candidate.prediction.peak_memory <= self.max_memory

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if self.fits(c)]

    @property
    def choice(self) -> Candidate:
        """The fastest candidate that fits; a ``ValueError`` naming the smallest peak when none does."""
        fitting = self.fitting
        if not fitting:
            raise ValueError(self.nothing_fits("max_memory="))
        return fitting[0]

    def nothing_fits(self, cap: str) -> str:
        """Why no candidate fits the memory cap (named ``cap``, an argument or an option): the smallest peak."""
        smallest = min(self.candidates, key=lambda c: c.prediction.peak_memory)
        return (
            f"No (chunks, checkpoint, balance) is predicted to fit in {cap}{_bytes(self.max_memory or 0)} "
            f"per device: the smallest predicted peak is {_bytes(smallest.prediction.peak_memory)} "
            f"({smallest.describe()}). Use more devices, a smaller batch, a larger max_memory, or, where the "
            "split was not searched, balance='auto' or a split of your own."
        )

    @property
    def runner_up(self) -> Optional[Candidate]:
        fitting = self.fitting
        return fitting[1] if len(fitting) > 1 else None


def chunk_grid(batch_size: int) -> list[int]:
    """Powers of two up to the batch size, and the batch size.

    >>> chunk_grid(24)
    [1, 2, 4, 8, 16, 24]
    """
    grid, m = [], 1
    while m < batch_size:
        grid.append(m)
        m *= 2
    return [*grid, batch_size]


def checkpoint_modes(chunks: int) -> list[str]:
    """Every mode that differs for ``chunks`` micro-batches: from recomputing all to recomputing none.

    >>> checkpoint_modes(4)
    ['always', 'except_last', 'keep:2', 'keep:3', 'never']
    """
    named = {0: "always", 1: "except_last", chunks: "never"}
    return [named.get(n, f"keep:{n}") for n in range(chunks + 1)]


def _moves(balance: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every split that moves one layer across one boundary of ``balance`` (no stage left empty)."""
    for j in range(len(balance) - 1):
        for give, take in ((j, j + 1), (j + 1, j)):
            if balance[give] > 1:
                moved = list(balance)
                moved[give] -= 1
                moved[take] += 1
                yield tuple(moved)


def faster_split(
    model: CostModel,
    batch_size: int,
    chunks: int,
    checkpoint: str,
    start: Sequence[int],
    link: LinkModel = LinkModel(),
    head: float = 0.0,
    max_memory: Optional[float] = None,
) -> tuple[tuple[int, ...], Prediction]:
    """The split near ``start`` whose replayed step is the shortest, and that replay: steepest descent, one layer
    across one boundary per move, while the step gets shorter (and, with ``max_memory``, through splits whose
    predicted peak fits only, from a ``start`` that fits).

    A split by time minimizes the largest stage's forward plus backward, which is the step only when every
    stage's passes have the same shape. A fill-drain step pays the slowest stage of each phase apart (stage
    0's forwards may be the slowest while stage 1's backwards are), recomputes lengthen the drain alone, and
    the messages and the output share delay the boundaries; the replay has all of it. Each move costs one
    replay; the descent ends at a split none of whose moves is faster (a local optimum, which for a few
    stages around the split by time is the one that matters).
    """

    def replay(balance: tuple[int, ...]) -> Prediction:
        return simulate(model.step_costs(balance, batch_size, chunks, head=head), checkpoint, link)

    def fits(prediction: Prediction) -> bool:
        return max_memory is None or prediction.peak_memory <= max_memory

    best = tuple(start)
    predicted = replay(best)
    while True:
        moves = [(p, moved) for p, moved in ((replay(moved), moved) for moved in _moves(best)) if fits(p)]
        if not moves:
            return best, predicted
        fastest, moved = min(moves, key=lambda move: move[0].step)
        if fastest.step >= predicted.step * (1 - 1e-9):  # no move shortens it beyond rounding
            return best, predicted
        best, predicted = moved, fastest


#: The predicted gain below which the default balance keeps the split by time: a profile's noise on a shared CPU.
DEFAULT_SEARCH_GAIN = 0.02


def searched_split(
    costs: LayerCosts, stages: int, chunks: int, checkpoint: str, min_gain: float = DEFAULT_SEARCH_GAIN
) -> tuple[list[int], Optional[str]]:
    """The default balance: the split by time of one profile, or the split near it whose replayed step is at least
    ``min_gain`` shorter (:func:`faster_split`), and a sentence saying so (``None`` where the split by time stays).

    It needs nothing beyond the profile the split by time is made from: the batch is ``chunks`` micro-batches of
    the profiled size, the link free. Measured through the Trainer on CPU-2 (``benchmarks/split_search.py``): where
    it moves a boundary (backbones whose first layers are frozen, which keep their forward but lose their
    backward) the step was 1.09x and 1.12x faster; where it does not, the split is the split by time.
    """
    by_time = optimal_balance(costs.time, stages)
    if stages < 2 or costs.batch < 1 or len(costs.forward) != len(costs.time):
        return by_time, None
    model, size = CostModel([costs]), costs.batch * chunks
    before = simulate(model.step_costs(by_time, size, chunks), checkpoint).step
    found, predicted = faster_split(model, size, chunks, checkpoint, by_time)
    if predicted.step > before * (1 - min_gain):
        return by_time, None
    return list(found), (
        f"The replay of a step ({chunks} micro-batches of {costs.batch}, checkpoint={checkpoint!r}) predicts "
        f"{list(found)} {before / predicted.step:.2f}x as fast as the split by time {by_time} "
        f"({predicted.step * 1e3:.1f} against {before * 1e3:.1f} ms): the stages' forwards and backwards weigh "
        "apart (frozen layers keep their forward, say), so the default balance takes it."
    )


def plan(
    model: CostModel,
    stages: int,
    batch_size: int,
    link: LinkModel = LinkModel(),
    max_memory: Optional[float] = None,
    chunks: Optional[Iterable[int]] = None,
    checkpoints: Optional[Callable[[int], Sequence[str]]] = None,
    splits: Sequence[Splitter] = (by_time,),
    head: float = 0.0,
    search: bool = False,
) -> Plan:
    """Replay every candidate for ``stages`` devices and a batch of ``batch_size``; see the module's docstring.

    ``chunks`` restricts M (default :func:`chunk_grid`), ``checkpoints`` gives the modes to try for an M
    (default :func:`checkpoint_modes`), ``splits`` the ways to split (each called per micro-batch size).
    ``search`` adds, per M, the splits :func:`faster_split` finds from each of those for the modes that
    recompute nothing and everything (the two ends of the drain's length), under ``max_memory`` also from the
    split by memory through fitting splits, and the splits one move away from those; every mode is replayed on
    them.
    """
    if stages > len(model):
        raise ValueError(f"Cannot plan {stages} stages for a backbone of {len(model)} layers.")
    grid = sorted({min(m, batch_size) for m in (chunks if chunks is not None else chunk_grid(batch_size))})
    found: list[Candidate] = []
    for m in grid:
        microbatch.check_chunks(m)
        size = batch_size / m
        modes = (checkpoints or checkpoint_modes)(m)
        balances = {tuple(split(model, stages, size)) for split in splits}
        if search:
            ends = [mode for mode in ("never", "always") if mode in modes] or list(modes[:1])
            found_splits = {
                faster_split(model, batch_size, m, mode, b, link, head)[0] for b in balances for mode in ends
            }
            if max_memory is not None:
                frugal = tuple(by_memory(model, stages, size))
                found_splits |= {frugal}
                found_splits |= {
                    faster_split(model, batch_size, m, mode, frugal, link, head, max_memory)[0] for mode in ends
                }
            balances |= found_splits
            balances |= {moved for b in found_splits for moved in _moves(b)}  # a runner-up split for the table
        for balance in sorted(balances):
            costs = model.step_costs(balance, batch_size, m, head=head)
            for mode in modes:
                found.append(Candidate(m, mode, balance, simulate(costs, mode, link), batch_size))
    # Fastest first; on a tie the smaller peak, then fewer micro-batches.
    found.sort(key=lambda c: (round(c.prediction.step, 12), c.prediction.peak_memory, c.chunks))
    return Plan(tuple(found), max_memory)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def plan_table(result: Plan, rows: Optional[int] = None) -> str:
    """A markdown table of the candidates, fastest first (the first ``rows``), the choice and runner-up marked."""
    choice = result.choice if result.fitting else None
    runner_up = result.runner_up
    lines = [
        "| | chunks | checkpoint | balance | step ms | samples/s | bubble | peak memory | fits |",
        "|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    shown = list(result.candidates[:rows] if rows else result.candidates)
    for extra in (choice, runner_up):
        if extra is not None and extra not in shown:
            shown.append(extra)
    for c in shown:
        mark = "choice" if c is choice else "runner-up" if c is runner_up else ""
        p, fits = c.prediction, "yes" if result.fits(c) else "no"
        lines.append(
            f"| {mark} | {c.chunks} | {c.checkpoint} | {list(c.balance)} | {p.step * 1e3:.2f} | "
            f"{c.samples_per_second:.1f} | {p.bubble:.3f} | {_bytes(p.peak_memory)} | {fits} |"
        )
    return "\n".join(lines)
