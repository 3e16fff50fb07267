"""treecp: context parallelism over packed prefix-tree rows.

A row packs trajectories that share prefixes (prompts) once: segments in DFS preorder, each with a
parent segment (or none) and a length. Token ids are physical positions in the packed row; a token's
logical position is its distance from the root along its root-to-leaf path. ``treecp.torch`` holds the
PyTorch ops (plan, dispatch/undispatch, attention, GDN/KDA, short convolution).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

try:
    # torch first when it is there: a CUDA build of the extension needs libcudart and libnccl, and whichever
    # copy the process loads first serves both. Loaded by the extension first, the toolkit's NCCL can lack
    # symbols torch's needs (`undefined symbol: ncclCommResume` on `import torch` after `import treecp`).
    import torch as _torch  # noqa: F401
except ImportError:
    pass

from . import _core

__all__ = ["Row", "PackedTrajectories", "layout_names"]


def layout_names() -> list[str]:
    """The planner's ownership layouts: contiguous, zigzag, perdoc, family, searched."""
    return list(_core.layout_names())


def _int_list(values, name: str) -> list[int]:
    if isinstance(values, np.ndarray) or hasattr(values, "tolist"):
        values = values.tolist()
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected a sequence of integers ({e})") from None
    return out


class PackedTrajectories(NamedTuple):
    """What :meth:`Row.from_trajectories` returns.

    ``tokens[i]`` is the id of packed token i, ``positions[i]`` its logical position, and
    ``index[t][j]`` the packed index of token j of trajectory t, so ``tokens[index[t]]`` is trajectory t.
    """

    row: "Row"
    tokens: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    index: list  # one int64 array per trajectory


class Row:
    """A packed prefix-tree row (segments in DFS preorder)."""

    def __init__(self, parents: Sequence[int], lengths: Sequence[int]):
        self._core = _core.Row(_int_list(parents, "parents"), _int_list(lengths, "lengths"))

    # ---- constructors from what trainers have

    @classmethod
    def from_segments(cls, parents: Sequence[int], lengths: Sequence[int]) -> "Row":
        """Segments in DFS preorder: ``parents[i]`` is an earlier segment or -1, ``lengths[i] > 0``."""
        return cls(parents, lengths)

    @classmethod
    def from_group_ids(cls, group_ids: Sequence[int], parent_ids: Sequence[int]) -> "Row":
        """Per-token group and parent-group ids (ART's form).

        Each group is one contiguous run of tokens (a segment); a root's tokens have
        ``parent_id == group_id``; trailing tokens with group -1 are padding and are not part of the
        row (``row.tokens`` is then shorter than the arrays). Parents precede their children.
        """
        groups = _int_list(group_ids, "group_ids")
        pars = _int_list(parent_ids, "parent_ids")
        if len(groups) != len(pars):
            raise ValueError(f"group_ids and parent_ids must have the same length, got {len(groups)} and {len(pars)}")
        valid = len(groups)
        while valid > 0 and groups[valid - 1] == -1:
            valid -= 1
        seg_of_group: dict[int, int] = {}
        parents: list[int] = []
        lengths: list[int] = []
        for t in range(valid):
            g, p = groups[t], pars[t]
            if g < 0:
                raise ValueError(f"group_ids[{t}] = {g}: padding (-1) may only trail the row")
            if t > 0 and groups[t - 1] == g:
                if p != pars[t - 1]:
                    raise ValueError(f"parent_ids[{t}] = {p}: group {g} already has parent {pars[t - 1]}")
                lengths[-1] += 1
                continue
            if g in seg_of_group:
                raise ValueError(f"group_ids[{t}] = {g}: group {g} appears in two runs (a group is one contiguous run)")
            if p == g:
                parent = -1
            elif p in seg_of_group:
                parent = seg_of_group[p]
            else:
                raise ValueError(f"parent_ids[{t}] = {p}: parent group {p} of group {g} does not precede it")
            seg_of_group[g] = len(parents)
            parents.append(parent)
            lengths.append(1)
        if not parents:
            raise ValueError("group_ids: the row has no token")
        return cls(parents, lengths)

    @classmethod
    def from_trajectories(cls, token_lists: Sequence[Sequence[int]]) -> PackedTrajectories:
        """Packs token sequences into a prefix tree (a trie whose single-child chains are segments).

        Shared prefixes are stored once. Children appear in order of first appearance; segments in DFS
        preorder. A trajectory may be a prefix of another (its tokens are then part of the other's path).
        """
        trajectories = [_int_list(t, f"token_lists[{i}]") for i, t in enumerate(token_lists)]
        if not trajectories:
            raise ValueError("token_lists: no trajectory")
        # Trie of tokens: node 0 is a virtual root; children keyed by token id, in insertion order.
        children: list[dict[int, int]] = [{}]
        token_of: list[int] = [-1]
        ends: list[int] = []
        for i, traj in enumerate(trajectories):
            if not traj:
                raise ValueError(f"token_lists[{i}]: empty trajectory")
            node = 0
            for tok in traj:
                nxt = children[node].get(tok)
                if nxt is None:
                    nxt = len(token_of)
                    children[node][tok] = nxt
                    children.append({})
                    token_of.append(tok)
                node = nxt
            ends.append(node)
        # DFS preorder over segments: a segment is a maximal chain of nodes with one child each.
        packed_of = [-1] * len(token_of)
        tokens: list[int] = []
        positions: list[int] = []
        parents: list[int] = []
        lengths: list[int] = []
        stack = [(child, -1, 0) for child in reversed(list(children[0].values()))]
        while stack:
            node, parent_seg, depth = stack.pop()
            seg = len(parents)
            parents.append(parent_seg)
            length = 0
            while True:
                packed_of[node] = len(tokens)
                tokens.append(token_of[node])
                positions.append(depth + length)
                length += 1
                if len(children[node]) != 1:
                    break
                node = next(iter(children[node].values()))
            lengths.append(length)
            for child in reversed(list(children[node].values())):
                stack.append((child, seg, depth + length))
        packed = np.asarray(packed_of, dtype=np.int64)
        index = []
        for i, traj in enumerate(trajectories):
            # Walk each trajectory again: its nodes are its path in the trie.
            node, path = 0, []
            for tok in traj:
                node = children[node][tok]
                path.append(node)
            index.append(packed[np.asarray(path, dtype=np.int64)])
        row = cls(parents, lengths)
        return PackedTrajectories(row, np.asarray(tokens, dtype=np.int64), np.asarray(positions, dtype=np.int64), index)

    @classmethod
    def from_json(cls, text: str) -> "Row":
        """The CLI's JSON row format: ``{"segments":[{"parent":-1,"length":1024}, ...]}``."""
        row = cls.__new__(cls)
        row._core = _core.Row.from_json(text)
        return row

    # ---- what a row tells

    def to_json(self) -> str:
        return self._core.to_json()

    @property
    def tokens(self) -> int:
        return self._core.tokens

    @property
    def num_segments(self) -> int:
        return self._core.num_segments

    @property
    def parents(self) -> list[int]:
        return list(self._core.parents)

    @property
    def lengths(self) -> list[int]:
        return list(self._core.lengths)

    @property
    def starts(self) -> list[int]:
        """First physical token of each segment."""
        return list(self._core.starts)

    def positions(self) -> np.ndarray:
        """Logical position of every packed token (int64 [tokens])."""
        return self._core.positions()

    def leaves(self) -> list[int]:
        """Leaf segments: one per trajectory (root-to-leaf path)."""
        return list(self._core.leaves())

    def trajectory_tokens(self, leaf: int) -> np.ndarray:
        """Packed indices of the tokens on the root-to-leaf path ending at segment ``leaf``."""
        parents, starts, lengths = self.parents, self.starts, self.lengths
        if not 0 <= leaf < len(parents):
            raise ValueError(f"leaf: segment {leaf} out of range for a row of {len(parents)} segments")
        chain = []
        s = leaf
        while s != -1:
            chain.append(s)
            s = parents[s]
        return np.concatenate([np.arange(starts[s], starts[s] + lengths[s], dtype=np.int64) for s in reversed(chain)])

    def visible(self, query: int, key: int, window: int = 0) -> bool:
        """Query token ``query`` sees key token ``key`` (tree visibility, optional sliding window)."""
        return self._core.visible(query, key, window)

    def __eq__(self, other) -> bool:
        return isinstance(other, Row) and self.parents == other.parents and self.lengths == other.lengths

    def __repr__(self) -> str:
        return f"treecp.Row({self.num_segments} segments, {self.tokens} tokens)"
