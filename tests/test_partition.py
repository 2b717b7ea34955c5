"""Balance: the optimal contiguous split, checked against brute force, and explicit balances validated."""

import itertools
import random

import pytest
from torch import nn

from lightning_gpipe.engine import partition
from lightning_gpipe.engine.partition import balance, balance_by_params, parameter_costs, stage_bounds, validate_balance


def _compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _objective(costs, sizes):
    stage_costs, start = [], 0
    for size in sizes:
        stage_costs.append(sum(costs[start : start + size]))
        start += size
    return max(stage_costs), sum(c * c for c in stage_costs), sizes


def test_balance_equals_brute_force_on_random_cost_vectors():
    rng = random.Random(0)
    checked = 0
    while checked < 600:
        n = rng.randint(1, 12)
        k = rng.randint(1, min(n, 5))
        kind = rng.random()
        if kind < 0.3:  # small integers: many ties
            costs = [rng.randint(0, 4) for _ in range(n)]
        elif kind < 0.6:
            costs = [rng.random() for _ in range(n)]
        else:
            costs = [rng.choice([1.0, 10.0, 100.0]) * rng.random() for _ in range(n)]
        got = balance(costs, k)
        best = min(_objective(costs, sizes) for sizes in _compositions(n, k))
        assert len(got) == k and sum(got) == n and min(got) >= 1
        # same bottleneck, same tie-break (sum of squares, then lexicographic)
        assert _objective(costs, got)[0] == pytest.approx(best[0], rel=1e-9, abs=1e-12), (costs, k, got, best)
        assert got == best[2] or _objective(costs, got)[:2] == pytest.approx(best[:2], rel=1e-9, abs=1e-12)
        checked += 1


def test_balance_is_deterministic_on_ties():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([0, 0, 0], 3) == [1, 1, 1]
    assert balance([5, 0, 0, 5], 2) == balance([5, 0, 0, 5], 2)


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="Cannot split 3 layers into 4 stages.*at most 3 devices"):
        balance([1, 2, 3], 4)


def test_negative_costs_are_rejected():
    with pytest.raises(ValueError, match="non-negative"):
        balance([1, -1], 1)


def test_balance_by_params_splits_by_parameter_count():
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    assert parameter_costs(model) == [110.0, 0.0, 110.0, 110.0, 110.0]
    assert balance_by_params(model, 2) == [3, 2]


def test_explicit_balance_must_sum_to_the_layer_count():
    with pytest.raises(
        ValueError, match=r"`balance=\[2, 2\]` sums to 4 but the backbone has 5 layers.*balance=\[3, 2\]"
    ):
        validate_balance([2, 2], 5, 2)


def test_explicit_balance_needs_one_entry_per_stage():
    with pytest.raises(ValueError, match="has 3 entries but the pipeline has 2 stages"):
        validate_balance([1, 2, 2], 5, 2)


@pytest.mark.parametrize("bad", [[0, 5], [2.5, 2.5], [], [True, 4]])
def test_explicit_balance_entries_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="list of positive integers"):
        validate_balance(bad, 5)


def test_an_explicit_balance_for_more_stages_than_layers_says_so_instead_of_suggesting_a_zero():
    # before: "the entries must sum to the number of layers, e.g. balance=[1, 0]", which is then refused
    with pytest.raises(ValueError, match="Cannot split 1 layers into 2 stages.*Use at most 1 devices"):
        validate_balance([1, 1], 1, 2)
    with pytest.raises(ValueError, match="Cannot split 2 layers into 3 stages"):
        validate_balance([1, 1, 1], 2)  # the count of entries alone
    with pytest.raises(ValueError, match="The backbone has no layers: an empty nn.Sequential"):  # not "at most 0"
        validate_balance([1], 0, 1)
    with pytest.raises(ValueError, match="The backbone has no layers"):
        balance_by_params(nn.Sequential(), 1)


def test_numpy_integers_are_whole_numbers_of_layers_and_come_back_as_ints():
    import numpy as np

    values = validate_balance([np.int64(2), np.int32(3)], 5, 2)
    assert values == [2, 3] and all(type(v) is int for v in values)


def test_stage_bounds():
    assert stage_bounds([2, 1, 3]) == [(0, 2), (2, 3), (3, 6)]


def test_an_automatic_split_keeps_a_module_used_in_several_layers_on_one_stage():
    # the same Linear object at layers 1 and 3 (and a shared submodule at 4 and 6): find_ties refuses a split
    # between its places, so the automatic splits never make one
    block, inner = nn.Linear(8, 8), nn.Linear(8, 8)
    module = nn.Sequential(
        nn.Linear(8, 8), block, nn.Tanh(), block, nn.Sequential(inner), nn.Tanh(), nn.Sequential(inner, nn.Tanh())
    )
    assert partition.shared_spans(module) == [(1, 3), (4, 6)]
    assert partition.shared_spans(nn.Sequential(block, nn.Tanh(), block, inner, block)) == [(0, 4)]  # merged
    for stages in (2, 3):
        balance = partition.balance_by_params(module, stages)
        cuts = {sum(balance[:s]) for s in range(1, stages)}
        assert not cuts & {2, 3, 5, 6}, balance
    assert partition.balance_keeping_together([5.0, 1, 1, 1, 5], 2, [(1, 3)]) == [1, 4]
    assert partition.balance_keeping_together([1.0, 1, 1, 1], 2, []) == partition.balance([1.0, 1, 1, 1], 2)


def test_a_layer_whose_output_cannot_leave_a_stage_is_kept_with_the_next_and_merged_with_shared_spans():
    block = nn.Linear(4, 4)
    module = nn.Sequential(nn.Tanh(), block, nn.Tanh(), block, nn.Tanh(), nn.Tanh(), nn.Tanh())
    assert partition.kept_together(module) == [(1, 3)]
    assert partition.kept_together(module, [True] * 7) == [(1, 3)]
    # layer 3's output cannot leave: 3-4 overlaps the shared 1-3; layer 6 is the last, its output leaves no stage
    assert partition.kept_together(module, [True, True, True, False, True, True, False]) == [(1, 4)]
    assert partition.kept_together(module, [False, True, True, True, True, False, True]) == [(0, 3), (5, 6)]
    costs = [1.0] * 7
    balance = partition.balance_keeping_together(costs, 3, partition.kept_together(module, [False] + [True] * 6))
    assert sum(balance[:1]) >= 4 and sum(balance) == 7, balance
    with pytest.raises(ValueError, match=r"layers 0-6 must stay on one stage.*samples in dim 0 \(an LSTM's h and c\)"):
        partition.balance_keeping_together(costs, 2, partition.kept_together(module, [False] * 7))


def test_a_module_shared_across_every_layer_leaves_too_few_parts_and_the_error_names_sharing_parameters_only():
    block = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"layers 0-2 must stay on one stage, which leaves 1 part\(s\).*second.weight"):
        partition.balance_by_params(nn.Sequential(block, block, block), 2)
