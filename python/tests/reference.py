"""Independent references for the tests, built in torch from parent pointers alone (never from treecp's
slices, plans or C++ code): dense masked attention, the GDN/KDA token recurrence and the causal
convolution along each token's tree path."""

from __future__ import annotations

import torch


def segment_layout(parents, lengths):
    """Per token: its segment, its logical position; per segment: its first physical token."""
    seg_of, pos, starts = [], [], []
    logical_start = []
    at = 0
    for s, (p, n) in enumerate(zip(parents, lengths)):
        starts.append(at)
        logical_start.append(0 if p < 0 else logical_start[p] + lengths[p])
        for i in range(n):
            seg_of.append(s)
            pos.append(logical_start[s] + i)
        at += n
    return seg_of, pos, starts


def ancestors_or_self(parents, s):
    out = set()
    while s >= 0:
        out.add(s)
        s = parents[s]
    return out


def visibility_mask(parents, lengths, window=None):
    """mask[i, j]: query i sees key j (tree visibility, causal inside a segment, optional window)."""
    seg_of, pos, _ = segment_layout(parents, lengths)
    t = len(seg_of)
    anc = [ancestors_or_self(parents, s) for s in range(len(parents))]
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        for j in range(t):
            ok = seg_of[j] in anc[seg_of[i]] and (seg_of[j] != seg_of[i] or j <= i)
            if ok and window is not None:
                ok = pos[i] - pos[j] < window
            mask[i, j] = ok
    return mask


def dense_attention(q, k, v, mask, sink=None, scale=None):
    """o, lse of masked softmax attention; q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]; GQA by repetition."""
    hq, hkv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kk = k.repeat_interleave(hq // hkv, dim=1)
    vv = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = s.masked_fill(~mask.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, T]
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", p, vv)
    lse = lse.transpose(0, 1)  # [T, H]
    if sink is not None:
        w = torch.exp(lse - torch.logaddexp(lse, sink.unsqueeze(0)))
        o = o * w.unsqueeze(-1)
    return o, lse


def _segment_tokens(parents, lengths):
    _, _, starts = segment_layout(parents, lengths)
    return [list(range(starts[s], starts[s] + lengths[s])) for s in range(len(parents))]


def gdn_tree(q, k, v, g, beta, parents, lengths, scale):
    """The GDN/KDA recurrence per token, each segment starting from its parent segment's final state.

    S_pre = diag(exp g) S;  delta = beta (v - S_pre^T k);  S = S_pre + k delta^T;  y = scale S^T q.
    """
    t, h, dk = q.shape
    dv = v.shape[2]
    final = {}
    ys = [None] * t
    for s, toks in enumerate(_segment_tokens(parents, lengths)):
        state = final[parents[s]] if parents[s] >= 0 else q.new_zeros(h, dk, dv)
        for i in toks:
            a = torch.exp(g[i]) if g.dim() == 3 else torch.exp(g[i]).unsqueeze(-1).expand(h, dk)
            pre = a.unsqueeze(-1) * state
            delta = beta[i].unsqueeze(-1) * (v[i] - torch.einsum("hde,hd->he", pre, k[i]))
            state = pre + k[i].unsqueeze(-1) * delta.unsqueeze(1)
            ys[i] = scale * torch.einsum("hde,hd->he", state, q[i])
        final[s] = state
    return torch.stack(ys)


def conv_tree(x, weight, bias, parents, lengths, silu):
    """y_t = bias + sum_i weight[:, K-1-i] x_{pred^i(t)} along the token's logical path, then silu."""
    seg_of, _, starts = segment_layout(parents, lengths)
    width = weight.shape[1]
    ys = []
    for t in range(x.shape[0]):
        acc = bias.clone() if bias is not None else x.new_zeros(x.shape[1])
        cur = t
        for i in range(width):
            if cur < 0:
                break
            acc = acc + weight[:, width - 1 - i] * x[cur]
            s = seg_of[cur]
            if cur > starts[s]:
                cur -= 1
            else:  # a segment's first token continues its parent's last
                p = parents[s]
                cur = starts[p] + lengths[p] - 1 if p >= 0 else -1
        ys.append(torch.nn.functional.silu(acc) if silu else acc)
    return torch.stack(ys)


def random_row(gen: torch.Generator, segments: int, max_len: int):
    """A random DFS-preorder tree: each new segment hangs under a segment on the current root path."""
    parents, lengths = [], []
    path = []
    for s in range(segments):
        if s == 0 or torch.rand(1, generator=gen).item() < 0.15:
            parent = -1
            path = []
        else:
            cut = int(torch.randint(0, len(path) + 1, (1,), generator=gen).item())
            path = path[:max(cut, 1)]
            parent = path[-1]
        parents.append(parent)
        lengths.append(int(torch.randint(1, max_len + 1, (1,), generator=gen).item()))
        path.append(s)
    return parents, lengths
