"""Rows from what trainers have: segments, per-token group/parent ids, token lists (the trie builder)."""

import random

import numpy as np
import pytest

import treecp
from reference import segment_layout


def test_design_example_positions_and_visibility():
    # DESIGN.md: root 0-3, A 4-6, B 7-8; B's tokens have logical positions 4, 5.
    row = treecp.Row.from_segments([-1, 0, 0], [4, 3, 2])
    assert row.tokens == 9 and row.num_segments == 3
    assert row.positions().tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5]
    assert [j for j in range(9) if row.visible(8, j)] == [0, 1, 2, 3, 7, 8]
    assert [j for j in range(9) if row.visible(8, j, window=3)] == [3, 7, 8]
    assert row.trajectory_tokens(2).tolist() == [0, 1, 2, 3, 7, 8]


def test_from_group_ids_matches_segments_and_drops_trailing_padding():
    groups = [5, 5, 5, 9, 9, 2, 2, 2, 7, -1, -1]
    parent = [5, 5, 5, 5, 5, 5, 5, 5, 7, -1, -1]  # 5 root, 9 and 2 children of 5, 7 a second root
    row = treecp.Row.from_group_ids(groups, parent)
    assert row.parents == [-1, 0, 0, -1] and row.lengths == [3, 2, 3, 1]


@pytest.mark.parametrize("groups,parents,needle", [
    ([0, 0, 1, 0], [0, 0, 0, 0], "two runs"),
    ([0, 0, 1, 1], [0, 0, 3, 3], "does not precede"),
    ([0, -1, 1], [0, -1, 0], "padding"),
    ([0, 0, 1, 1], [0, 0, 0, 1], "already has parent"),
    ([0, 0], [0], "same length"),
])
def test_from_group_ids_errors_name_the_token(groups, parents, needle):
    with pytest.raises(ValueError, match=needle):
        treecp.Row.from_group_ids(groups, parents)


def test_from_segments_errors_name_the_segment():
    with pytest.raises(ValueError, match="segment 1"):
        treecp.Row.from_segments([-1, 0], [3, 0])
    with pytest.raises(ValueError, match=r"parents\[1\]"):
        treecp.Row.from_segments([-1, 7], [3, 2])
    with pytest.raises(TypeError, match="lengths"):
        treecp.Row.from_segments([-1], ["x"])


def test_from_trajectories_round_trip_on_random_token_lists():
    rng = random.Random(1234)
    for _ in range(20):
        prompts = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 4))]
        trajs = []
        for _ in range(rng.randint(1, 10)):
            p = rng.choice(prompts)
            trajs.append(p + [rng.randrange(50) for _ in range(rng.randint(0, 8))])
        packed = treecp.Row.from_trajectories(trajs)
        row = packed.row
        # Every trajectory is gathered back from the packed tokens, in order.
        for t, idx in zip(trajs, packed.index):
            assert packed.tokens[idx].tolist() == t
            # its tokens follow one root-to-leaf path: logical positions 0, 1, 2, ...
            assert packed.positions[idx].tolist() == list(range(len(t)))
            # consecutive tokens of a trajectory: the earlier one is visible from the later one
            assert all(row.visible(int(b), int(a)) for a, b in zip(idx[:-1], idx[1:]))
        # Shared prefixes are stored once: the row has exactly one token per distinct prefix.
        distinct = {tuple(t[:i + 1]) for t in trajs for i in range(len(t))}
        assert row.tokens == len(distinct) == len(packed.tokens)
        # positions agree with the row's own and with a recomputation from parent pointers
        _, pos, _ = segment_layout(row.parents, row.lengths)
        assert packed.positions.tolist() == row.positions().tolist() == pos


def test_from_trajectories_shares_the_prompt():
    packed = treecp.Row.from_trajectories([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 6, 7], [9]])
    # [1, 2, 3, 6] ends inside the segment 6, 7: a trajectory may be a prefix of another
    assert packed.row.parents == [-1, 0, 0, -1] and packed.row.lengths == [3, 2, 2, 1]
    assert packed.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 9]
    assert [i.tolist() for i in packed.index] == [[0, 1, 2, 3, 4], [0, 1, 2, 5], [0, 1, 2, 5, 6], [7]]
    assert isinstance(packed.tokens, np.ndarray) and packed.tokens.dtype == np.int64


def test_from_trajectories_errors():
    with pytest.raises(ValueError, match="no trajectory"):
        treecp.Row.from_trajectories([])
    with pytest.raises(ValueError, match=r"token_lists\[1\]: empty"):
        treecp.Row.from_trajectories([[1], []])


def test_json_round_trip():
    row = treecp.Row.from_segments([-1, 0, 1, 0], [5, 2, 3, 1])
    assert treecp.Row.from_json(row.to_json()) == row
    with pytest.raises(ValueError):
        treecp.Row.from_json('{"segments":[{"parent":3,"length":1}]}')
