"""treecp's PyTorch ops: plan a row once, move tokens to their owners, run tree attention, GDN/KDA
and short convolutions on this rank's tokens, with autograd and torch.compile support.

    key = treecp.torch.plan(row, group=None)          # once per row (and process group)
    x = key.dispatch(x_packed)                         # [tokens, ...] -> this rank's [n, ...]
    o, lse = treecp.torch.attention(q, k, v, key)      # q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, Dv]
    y = key.undispatch(o)                              # back to [tokens, ...]

Contract for gradients under CP (a group of cp > 1 ranks): every op returns this rank's contribution to
the gradients of tensors replicated across the group (weights, the sink, conv weights, and a replicated
input of dispatch); their sum over the ranks is the gradient, as for data-parallel replicas.
"""

from __future__ import annotations

from typing import Optional

from .. import Row
from ._key import Key
from ._ops import _CUDA_ATTENTION_DIMS as CUDA_ATTENTION_DIMS
from ._ops import attention, gated_delta_rule, short_conv

__all__ = ["Key", "plan", "attention", "gated_delta_rule", "short_conv", "CUDA_ATTENTION_DIMS"]


def plan(row: Row, group=None, window: Optional[int] = None, layout: str = "searched", costs=None) -> Key:
    """Plans ``row`` for the ranks of ``group`` (a torch process group; None = this process alone).

    ``window``: sliding window in logical positions (None = none). ``layout``: one of
    treecp.layout_names(). ``costs``: None (coefficients of one H200 per rank), "cpu" (this project's
    CPU ranks) or a path to a coefficient file. Every rank of the group must call it with the same
    arguments (checked: a mismatch raises ValueError on every rank).
    """
    return Key(row, group, window, layout, costs)
