"""A small causal transformer trained on packed prefix-tree rows, against the same trajectories flattened.

RL post-training samples several completions per prompt. Packed as a tree, each prompt is stored and
computed once; treecp's ops make every token see exactly its own trajectory, so losses, gradients and
per-trajectory log-probs equal those of running every trajectory alone. This script trains the same
model both ways for a few steps and checks that they agree at every step:

  * RoPE on logical positions (a completion continues its prompt's positions),
  * GQA attention with a learned sink, one layer over the whole tree, one with a sliding window,
  * a Gated DeltaNet layer with short convolutions on q, k, v,
  * next-token log-probs per trajectory: the prompt's last token predicts each completion's first.

    python examples/tree_transformer.py                 # one process, float64
    python examples/tree_transformer.py --cp 2          # CP over 2 gloo processes on this machine
    python examples/tree_transformer.py --dtype float32 --steps 5

Under CP each rank holds its tokens (key.dispatch), computes the log-probs of the pairs whose
predicting token it owns, and the gradients of the weights (replicated over the group) are summed
with an all-reduce, as for data-parallel replicas. It exits 1 when packed and flattened disagree.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import treecp
import treecp.torch as tt


class Config:
    vocab = 32
    dim = 32
    heads = 4        # query heads
    kv_heads = 2     # GQA
    head_dim = 8
    window = 6       # the sliding-window layer, in logical positions
    gdn_heads = 2
    gdn_dim = 8
    conv_width = 4


def rope(x, positions, base=10000.0):
    """Rotary embedding on [n, H, D] at the given (logical) positions, rotate-half convention."""
    d = x.shape[-1]
    freq = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    angle = positions.to(x.dtype)[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, c: Config, windowed: bool):
        super().__init__()
        self.c, self.windowed = c, windowed
        self.q = torch.nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.kv = torch.nn.Linear(c.dim, 2 * c.kv_heads * c.head_dim, bias=False)
        self.o = torch.nn.Linear(c.heads * c.head_dim, c.dim, bias=False)
        self.sink = torch.nn.Parameter(torch.zeros(c.heads))

    def forward(self, x, keys, positions):
        c, n = self.c, x.shape[0]
        q = rope(self.q(x).view(n, c.heads, c.head_dim), positions)
        k, v = self.kv(x).view(n, 2, c.kv_heads, c.head_dim).unbind(1)
        k = rope(k, positions)
        o, _ = tt.attention(q.contiguous(), k.contiguous(), v.contiguous(), keys["window" if self.windowed else "full"],
                            sink=self.sink)
        return self.o(o.reshape(n, c.heads * c.head_dim))


class GatedDeltaNet(torch.nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        width = c.gdn_heads * c.gdn_dim
        self.qkv = torch.nn.Linear(c.dim, 3 * width, bias=False)
        self.conv = torch.nn.Parameter(torch.randn(3 * width, c.conv_width) / math.sqrt(c.conv_width))
        self.gates = torch.nn.Linear(c.dim, 2 * c.gdn_heads)
        self.o = torch.nn.Linear(width, c.dim, bias=False)

    def forward(self, x, keys, positions):
        c, n = self.c, x.shape[0]
        qkv = tt.short_conv(self.qkv(x), self.conv, keys["full"], activation="silu")
        q, k, v = qkv.view(n, 3, c.gdn_heads, c.gdn_dim).unbind(1)
        a, b = self.gates(x).view(n, 2, c.gdn_heads).unbind(1)
        y = tt.gated_delta_rule(F.normalize(q, dim=-1).contiguous(), F.normalize(k, dim=-1).contiguous(),
                                v.contiguous(), F.logsigmoid(a).contiguous(), b.sigmoid().contiguous(), keys["full"])
        return self.o(y.reshape(n, c.gdn_heads * c.gdn_dim))


class Block(torch.nn.Module):
    def __init__(self, c: Config, mixer):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(c.dim), torch.nn.RMSNorm(c.dim)
        self.mixer = mixer
        self.up = torch.nn.Linear(c.dim, 4 * c.dim, bias=False)
        self.down = torch.nn.Linear(2 * c.dim, c.dim, bias=False)

    def forward(self, x, keys, positions):
        x = x + self.mixer(self.norm1(x), keys, positions)
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyModel(torch.nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab, c.dim)
        self.blocks = torch.nn.ModuleList([Block(c, Attention(c, windowed=False)), Block(c, GatedDeltaNet(c)),
                                           Block(c, Attention(c, windowed=True))])
        self.norm = torch.nn.RMSNorm(c.dim)
        self.head = torch.nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens, keys):
        """Logits of this rank's tokens; `tokens` is the whole packed row, dispatched here."""
        x = keys["full"].dispatch(self.embed(tokens))
        positions = keys["full"].position_ids()
        for block in self.blocks:
            x = block(x, keys, positions)
        return self.head(self.norm(x))


class Batch:
    """One packed row and what the loss needs: tokens, keys, and the (predicting token, target) pairs."""

    def __init__(self, token_lists, group, window, packed: bool):
        if packed:
            p = treecp.Row.from_trajectories(token_lists)
            row, tokens, index = p.row, p.tokens, p.index
        else:  # every trajectory its own root: nothing shared
            row = treecp.Row.from_segments([-1] * len(token_lists), [len(t) for t in token_lists])
            tokens = [tok for t in token_lists for tok in t]
            starts = [0]
            for t in token_lists:
                starts.append(starts[-1] + len(t))
            index = [list(range(s, e)) for s, e in zip(starts[:-1], starts[1:])]
        full = tt.plan(row, group=group)
        self.keys = {"full": full, "window": full.with_window(window)}
        self.row = row
        self.tokens = torch.as_tensor(tokens, dtype=torch.int64)
        src, dst = [], []
        for idx in index:
            idx = list(map(int, idx))
            src += idx[:-1]
            dst += idx[1:]
        self.src, self.target = torch.tensor(src), self.tokens[torch.tensor(dst)]
        # the pairs whose predicting token this rank owns, and that token's row here
        local_row = torch.full((row.tokens,), -1, dtype=torch.int64)
        local_row[full.index] = torch.arange(full.local_tokens)
        self.mine = torch.nonzero(local_row[self.src] >= 0).flatten()
        self.mine_row = local_row[self.src[self.mine]]


def step(model, batch: Batch, group):
    """Per-pair log-probs (every rank gets all of them) and the loss; gradients summed over the group."""
    logits = model(batch.tokens, batch.keys)
    logp = torch.log_softmax(logits[batch.mine_row], dim=-1).gather(1, batch.target[batch.mine, None]).squeeze(1)
    loss = -logp.sum() / batch.src.numel()
    model.zero_grad()
    loss.backward()
    every = torch.zeros(batch.src.numel(), dtype=logp.dtype)
    every[batch.mine] = logp.detach()
    if group is not None:
        dist.all_reduce(every, group=group)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
    return -every.sum() / every.numel(), every


def trajectories(seed: int, vocab: int):
    """Prompts with several completions each, as a rollout engine returns them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        prompt = torch.randint(0, vocab, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist()
        for _ in range(int(torch.randint(2, 5, (1,), generator=g))):
            n = int(torch.randint(1, 9, (1,), generator=g))
            out.append(prompt + torch.randint(0, vocab, (n,), generator=g).tolist())
    return out


def train(args, group) -> int:
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    c = Config()
    tree_model = TinyModel(c).to(dtype)
    flat_model = copy.deepcopy(tree_model)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (tree_model, flat_model)]
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    rank = dist.get_rank(group) if group is not None else 0
    worst = 0.0
    for s in range(args.steps):
        trajs = trajectories(args.seed * 1000 + s, c.vocab)
        packed = Batch(trajs, group, c.window, packed=True)
        flat = Batch(trajs, None, c.window, packed=False)
        loss_tree, logp_tree = step(tree_model, packed, group)
        loss_flat, logp_flat = step(flat_model, flat, None)
        grad_scale = max(p.grad.abs().max().item() for p in flat_model.parameters())
        grad_diff = max((a.grad - b.grad).abs().max().item()
                        for a, b in zip(tree_model.parameters(), flat_model.parameters())) / grad_scale
        logp_diff = (logp_tree - logp_flat).abs().max().item()
        loss_diff = abs(loss_tree.item() - loss_flat.item())
        worst = max(worst, grad_diff, logp_diff, loss_diff)
        if rank == 0:
            if s == 0:
                print(f"{'step':>4} {'tokens tree/flat':>17} {'loss tree':>12} {'loss flat':>12} {'|dloss|':>9} "
                      f"{'max|dlogp|':>10} {'grad rel diff':>13}")
            print(f"{s:4d} {packed.row.tokens:8d}/{flat.row.tokens:<8d} {loss_tree.item():12.6f} {loss_flat.item():12.6f} "
                  f"{loss_diff:9.2e} {logp_diff:10.2e} {grad_diff:13.2e}")
        for o in opts:
            o.step()
    ok = worst <= tol
    if rank == 0:
        cp = dist.get_world_size(group) if group is not None else 1
        print(f"packed ({'CP %d' % cp}) vs flattened, {args.dtype}: worst deviation {worst:.2e} "
              f"({'within' if ok else 'OUTSIDE'} {tol:.0e})")
    return 0 if ok else 1


def _rank_main(rank, args, port, codes):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.cp)
    try:
        codes.put((rank, train(args, dist.group.WORLD)))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cp", type=int, default=1, help="CP ranks: gloo processes on this machine")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cp == 1:
        return train(args, None)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    codes = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, args, port, codes)) for r in range(args.cp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    results = []
    while not codes.empty():
        results.append(codes.get()[1])
    return 0 if len(results) == args.cp and all(r == 0 for r in results) and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
