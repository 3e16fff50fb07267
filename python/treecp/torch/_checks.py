"""The argument check that both the key (dispatch/undispatch) and the ops give every tensor: one home, so
that _key and _ops need not import each other."""

from __future__ import annotations

from typing import Optional

from torch import Tensor


def _check_tensor(op: str, name: str, x, leading: Optional[int] = None, what: str = "") -> Optional[str]:
    """The checks every tensor argument gets; returns a message naming the argument, or None."""
    if not isinstance(x, Tensor):
        return f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}"
    if leading is not None and (x.dim() == 0 or x.shape[0] != leading):
        return f"{op}: {name} has shape {tuple(x.shape)}; its first dimension must be {leading} ({what})"
    return None
