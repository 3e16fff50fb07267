"""GPU tests (bf16/fp16 on CUDA, one process): skipped without a GPU, and while the build has no CUDA
backend (treecp._core.has_cuda_backend). Errors are bounded by the same-precision torch reference's own."""

import pytest
import torch

import treecp
import treecp.torch as tt
from reference import dense_attention, random_row, visibility_mask

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine"),
    pytest.mark.skipif(not treecp._core.has_cuda_backend, reason="this build of treecp has no CUDA backend"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 300])
def test_attention_on_cuda_is_as_accurate_as_torch_in_the_same_precision(dtype, window):
    gen = torch.Generator().manual_seed(5)
    parents, lengths = random_row(gen, 24, 200)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row, window=window)
    t, hq, hkv, d = row.tokens, 8, 2, 128
    q, k, v = (torch.randn(t, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv))
    sink = torch.randn(hq, dtype=torch.float64, generator=gen)
    g = torch.randn(t, hq, d, dtype=torch.float64, generator=gen)
    mask = visibility_mask(parents, lengths, window)
    leaves = [x.requires_grad_() for x in (q, k, v, sink)]
    o64, _ = dense_attention(q, k, v, mask, sink)
    truth = torch.autograd.grad((o64 * g).sum(), leaves)
    low = [x.detach().to(dtype).requires_grad_() for x in leaves]
    o_ref, _ = dense_attention(*low[:3], mask, low[3])
    ref = torch.autograd.grad((o_ref * g.to(dtype)).sum(), low)
    dev = [x.detach().cuda().requires_grad_() for x in low]
    o, _ = tt.attention(*dev[:3], key, sink=dev[3])
    got = torch.autograd.grad((o * g.to(dtype).cuda()).sum(), dev)
    for name, a, b, c in zip(("o", "dq", "dk", "dv", "dsink"), (o,) + got, (o_ref,) + ref, (o64,) + truth):
        err = (a.double().cpu() - c).abs().max().item()
        err_ref = (b.double() - c).abs().max().item()
        assert err <= 3 * err_ref + 1e-3, (name, err, err_ref)
