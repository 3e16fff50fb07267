"""The key: one row planned once for one process group, reused by every layer."""

from __future__ import annotations

import math
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .. import Row, _core, layout_names
from ._checks import _check_tensor
from ._comm import GroupCommunicator, collective_device

# Keys by id: the custom ops take a key as its string id (Key.id); torch.compile sees only tensors and constants.
_KEYS: "weakref.WeakValueDictionary[str, Key]" = weakref.WeakValueDictionary()
_next_key_id = 0

_PACKAGED_COSTS = {"default": "costs_default.json", "cpu": "costs_cpu.json"}


def _costs_path(costs) -> str:
    if costs is None:
        return ""
    if not isinstance(costs, (str, os.PathLike)):
        raise TypeError(f"costs: expected None, 'default', 'cpu' or a path to a coefficient file, got {type(costs).__name__}")
    costs = os.fspath(costs)
    if costs in _PACKAGED_COSTS:
        return os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", _PACKAGED_COSTS[costs])
    if not os.path.isfile(costs):
        raise ValueError(f"costs: no coefficient file at {costs!r} (or pass 'default' or 'cpu')")
    return costs


class Key:
    """One row's plan for one process group: which packed tokens this rank owns, and the runtimes.

    Build it with :func:`treecp.torch.plan` on every rank of the group with the same arguments.
    """

    def __init__(self, row: Row, group, window: Optional[int], layout: str, costs, _ownership=None):
        global _next_key_id
        if not isinstance(row, Row):
            raise TypeError(f"row: expected a treecp.Row, got {type(row).__name__}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"window: expected None or a positive int (tokens of logical distance), got {window!r}")
        if layout not in layout_names():
            raise ValueError(f"layout: expected one of {', '.join(layout_names())}, got {layout!r}")
        costs_path = _costs_path(costs)
        if group is not None:
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
            cp, rank = dist.get_world_size(group), dist.get_rank(group)
            if rank < 0:
                raise ValueError("group: this process is not a member of the group")
        else:
            cp, rank = 1, 0
        self.row = row
        self.group = group if cp > 1 else None
        # CUDA calls communicate over NCCL made from the group (any size, one rank included); set on first use.
        self.nccl_group = group
        self.nccl = None
        self.cuda_device: Optional[torch.device] = None
        self.window = window
        self.layout = layout
        self.cp, self.rank = cp, rank
        self.costs_file = costs_path
        if _ownership is None:
            self.plan = _core.make_plan(row._core, cp, layout, window or 0, costs_path)
        else:
            self.plan = _core.plan_for_ownership(row._core, _ownership, window or 0, costs_path)
        comm = GroupCommunicator(group) if cp > 1 else None
        self._core = _core.KeyCore(row._core, self.plan, rank, cp, comm)
        self._check_same_on_every_rank()
        self.index = torch.from_numpy(self._core.owned_index())
        self.owned_counts = list(self._core.owned_counts())
        self.tokens = row.tokens
        self.local_tokens = int(self._core.owned_tokens)
        self._positions = torch.from_numpy(row.positions()).index_select(0, self.index)
        self._on_device: dict = {}
        self._gather_order: dict = {}
        # A string, not an int: the custom ops take it as an argument, and torch.compile turns an int argument
        # that changes between compilations (a second key through the same code) into a SymInt, which cannot
        # name a key; strings stay constants of the graph.
        self.id = f"treecp-key-{_next_key_id}"
        _next_key_id += 1
        _KEYS[self.id] = self

    def with_window(self, window: Optional[int]) -> "Key":
        """A key for another sliding window (None = none) with this key's ownership.

        Layers with different windows then share one token layout: dispatch once, run them all. Every
        rank of the group calls it.
        """
        return Key(self.row, self.nccl_group, window, self.layout, self.costs_file or None, _ownership=self.plan)

    # ---- agreement: bad input on one rank is refused on every rank before any data moves

    def _check_same_on_every_rank(self):
        if self.cp == 1:
            return
        at = collective_device(self.group)
        mine = torch.tensor([self._core.fingerprint], dtype=torch.int64, device=at)
        every = torch.empty(self.cp, dtype=torch.int64, device=at)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        every = every.cpu()
        if not bool((every == every[0]).all()):
            differ = [r for r in range(self.cp) if int(every[r]) != int(every[0])]
            raise ValueError(
                f"plan: ranks {differ} planned another row, window, layout or cost model than rank 0; every rank of "
                "the group must call treecp.torch.plan with the same arguments")

    def agree(self, op: str, problem: Optional[str], same: Optional[tuple[str, bool]] = None):
        """Raises ValueError on every rank if any rank found a problem (``problem`` is this rank's), or if the choice
        ``same = (what, value)`` is not the same on every rank (the ops' collectives would not match), in the same
        all-gather."""
        if self.cp == 1:
            if problem:
                raise ValueError(problem)
            return
        at = collective_device(self.group)
        mine = (1 if problem else 0) | (2 if same and same[1] else 0)
        flags = torch.empty(self.cp, dtype=torch.int64, device=at)
        dist.all_gather_into_tensor(flags, torch.tensor([mine], dtype=torch.int64, device=at), group=self.group)
        flags = flags.cpu()
        bad = [r for r in range(self.cp) if int(flags[r]) & 1]
        if bad:
            if problem:
                raise ValueError(problem)
            raise ValueError(f"{op}: refused on every rank: bad input on rank{'s' if len(bad) > 1 else ''} "
                             f"{', '.join(map(str, bad))} (its error names the argument)")
        if same:
            on = [r for r in range(self.cp) if int(flags[r]) & 2]
            if 0 < len(on) < self.cp:
                raise ValueError(f"{op}: refused on every rank: {same[0]} holds on rank{'s' if len(on) > 1 else ''} "
                                 f"{', '.join(map(str, on))} only; every rank must make the same choice")

    # ---- token movement

    def _index_on(self, device):
        device = torch.device(device)
        if device.type == "cpu":
            return self.index
        if device not in self._on_device:
            self._on_device[device] = self.index.to(device)
        return self._on_device[device]

    def position_ids(self, device=None) -> torch.Tensor:
        """Logical positions (int64) of this rank's tokens, for rotary embeddings."""
        return self._positions if device is None else self._positions.to(device)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a packed token-major tensor ``[tokens, ...]``.

        Backward: the gradient lands in this rank's rows, zero elsewhere (this rank's contribution).
        """
        problem = _check_tensor("dispatch", "x", x, leading=self.tokens, what="tokens of the row")
        if self.cp == 1 or torch.compiler.is_compiling():
            if problem:
                raise ValueError(problem)
        else:
            self.agree("dispatch", problem)
        return x.index_select(0, self._index_on(x.device))

    def undispatch(self, x: torch.Tensor) -> torch.Tensor:
        """The whole packed tensor ``[tokens, ...]`` from every rank's rows (an all-gather).

        Backward: the exact adjoint, the gradient summed over the ranks of the group, this rank's rows.
        """
        problem = _check_tensor("undispatch", "x", x, leading=self.local_tokens, what="tokens this rank owns")
        if self.cp == 1:
            if problem:
                raise ValueError(problem)
            return x  # one rank owns every token, in order
        self.agree("undispatch", problem)
        return _Undispatch.apply(x, self)

    def __repr__(self):
        return (f"treecp.torch.Key({self.row!r}, cp={self.cp}, rank={self.rank}, layout={self.layout!r}, "
                f"window={self.window}, {self.local_tokens} tokens here)")


def _order(key: Key, device):
    """Canonical id of each row of the all-gathered, padded buffer, and where each canonical row sits in it."""
    cache = key._gather_order.setdefault(torch.device(device), {})
    if not cache:
        most = max(key.owned_counts)
        idx = torch.full((key.cp * most,), -1, dtype=torch.int64)
        ranks = []
        for r in range(key.cp):
            ranges = key.plan.owned_ranges(r)
            ids = torch.cat([torch.arange(b, e, dtype=torch.int64) for b, e in ranges]) if ranges else \
                torch.empty(0, dtype=torch.int64)
            idx[r * most:r * most + ids.numel()] = ids
            ranks.append(ids)
        slot = torch.empty(key.tokens, dtype=torch.int64)
        valid = idx >= 0
        slot[idx[valid]] = torch.nonzero(valid).flatten()
        cache.update(most=most, slot=slot.to(device), ranks=[ids.to(device) for ids in ranks])
    return cache


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key):
        order = _order(key, x.device)
        most = order["most"]
        padded = x.new_zeros((most,) + tuple(x.shape[1:]))
        padded[:x.shape[0]] = x
        gathered = x.new_empty((key.cp * most,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=key.group)
        ctx.key = key
        return gathered.index_select(0, order["slot"])

    @staticmethod
    def backward(ctx, grad):
        key = ctx.key
        order = _order(key, grad.device)
        most = order["most"]
        grad = grad.contiguous()
        send = grad.new_zeros((key.cp * most,) + tuple(grad.shape[1:]))
        for r, ids in enumerate(order["ranks"]):
            send[r * most:r * most + ids.numel()] = grad.index_select(0, ids)
        mine = grad.new_empty((most,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, send, op=dist.ReduceOp.SUM, group=key.group)
        return mine[:key.local_tokens], None


def key_of(key_id: str) -> Key:
    key = _KEYS.get(key_id)
    if key is None:
        raise ValueError(f"key: no live treecp key with id {key_id} (it was garbage-collected)")
    return key


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
