"""Group ids in every form a trainer hands them over: tensors, lists, numpy arrays, uid strings."""

import numpy as np
import pytest
import torch

from grouprl.algorithms import compute_advantages, filter_groups, group_statistics, reward_std_per_group
from grouprl.algorithms.advantages import dense_group_index

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 5.0, 0.5], dtype=torch.float64)
# Three groups, interleaved: rows 0, 1, 3 / rows 2, 4, 6 / row 5 alone.
IDS = [7, 7, 3, 7, 3, 42, 3]
UIDS = ["b7f0", "b7f0", "0a3c", "b7f0", "0a3c", "ffff-42", "0a3c"]

INT_KINDS = {
    "torch-long": lambda: torch.tensor(IDS),
    "torch-int32": lambda: torch.tensor(IDS, dtype=torch.int32),
    "torch-int16": lambda: torch.tensor(IDS, dtype=torch.int16),
    "torch-uint8": lambda: torch.tensor(IDS, dtype=torch.uint8),
    "list": lambda: list(IDS),
    "tuple": lambda: tuple(IDS),
    "numpy-int64": lambda: np.array(IDS),
    "numpy-uint32": lambda: np.array(IDS, dtype=np.uint32),
    "list-of-numpy-ints": lambda: [np.int64(i) for i in IDS],
}
STR_KINDS = {
    "list-of-str": lambda: list(UIDS),
    "numpy-str": lambda: np.array(UIDS),
    "numpy-object-str": lambda: np.array(UIDS, dtype=object),  # what verl's non_tensor_batch["uid"] holds
}
KINDS = {**INT_KINDS, **STR_KINDS}
REFERENCE = torch.tensor(IDS)

ESTIMATOR_CASES = {
    "grpo": {},
    "rloo": {},
    "grpo_passk": {},
    "reinforce_plus_plus_baseline": {"response_mask": torch.ones(7, 2)},
    "reinforce_plus_plus": {"response_mask": torch.ones(7, 2)},
    "remax": {"baseline_scores": torch.zeros(7, dtype=torch.float64)},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", sorted(ESTIMATOR_CASES))
def test_every_group_id_kind_gives_identical_advantages(name, kind):
    expected = compute_advantages(name, SCORES, REFERENCE, **ESTIMATOR_CASES[name])
    actual = compute_advantages(name, SCORES, KINDS[kind](), **ESTIMATOR_CASES[name])
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_filtering_and_statistics_accept_every_kind(kind):
    assert torch.equal(reward_std_per_group(SCORES, KINDS[kind]()), reward_std_per_group(SCORES, REFERENCE))
    assert torch.equal(filter_groups(SCORES, KINDS[kind]()), filter_groups(SCORES, REFERENCE))
    for actual, expected in zip(group_statistics(SCORES, KINDS[kind]()), group_statistics(SCORES, REFERENCE)):
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dense_group_index_numbers_groups_by_sorted_id(kind):
    dense = dense_group_index(KINDS[kind](), 7)
    assert dense.dtype == torch.long
    # Sorted ids 3 < 7 < 42 and "0a3c" < "b7f0" < "ffff-42" give the same numbering.
    assert dense.tolist() == [1, 1, 0, 1, 0, 2, 0]


def test_string_ids_are_grouped_by_value_not_by_position():
    adv = compute_advantages("grpo", torch.tensor([1.0, 0.0, 1.0, 0.0]), ["q1", "q2", "q1", "q2"])
    assert torch.equal(adv, torch.zeros(4))


def test_empty_batch():
    assert dense_group_index([], 0).tolist() == []
    assert dense_group_index(np.array([], dtype=object), 0).tolist() == []


@pytest.mark.parametrize(
    "group_index",
    [
        torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 2.0]),  # float ids: probably scores passed by mistake
        torch.tensor([True, True, False, False, True, True, True]),
        [0, 0, 1, 1, 2, 2, 2.5],
        [0, 0, 1, 1, "a", "a", "a"],
        np.array([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 2.0]),
        {0: 0},
        "abcdefg",
        None,
    ],
    ids=["torch-float", "torch-bool", "list-with-float", "mixed-int-str", "numpy-float", "dict", "str", "none"],
)
def test_unsupported_group_ids_are_rejected(group_index):
    with pytest.raises(TypeError, match="group_index"):
        compute_advantages("grpo", SCORES, group_index)


@pytest.mark.parametrize("group_index", [IDS[:-1], np.array(UIDS + ["x"]), torch.tensor(IDS[:5])])
def test_length_mismatch_is_reported(group_index):
    with pytest.raises(ValueError, match="group_index has .* ids .* 7 rows"):
        compute_advantages("grpo", SCORES, group_index)
    with pytest.raises(ValueError, match="group_index has .* ids .* 7 rows"):
        filter_groups(SCORES, group_index)


def test_two_dimensional_ids_are_rejected():
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages("grpo", SCORES, torch.zeros(7, 1, dtype=torch.long))
