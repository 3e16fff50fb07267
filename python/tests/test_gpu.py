"""GPU tests (bf16 on CUDA, one process): skipped without a GPU or when the build has no CUDA backend
(treecp._core.has_cuda_backend). Errors are bounded by the same-precision torch reference's own."""

import pytest
import torch

import treecp
import treecp.torch as tt
from reference import dense_attention, random_row, visibility_mask

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine"),
    pytest.mark.skipif(not treecp._core.has_cuda_backend, reason="this build of treecp has no CUDA backend"),
]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [None, 90])
def test_attention_on_cuda_is_as_accurate_as_torch_in_the_same_precision(d, window):
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    parents, lengths = random_row(gen, 12, 100)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row, window=window)
    t, hq, hkv = row.tokens, 8, 2
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
    assert o.dtype == dtype and all(g_.dtype == dtype for g_ in got)
    for name, a, b, c in zip(("o", "dq", "dk", "dv", "dsink"), (o,) + got, (o_ref,) + ref, (o64,) + truth):
        err = (a.double().cpu() - c).abs().max().item()
        err_ref = (b.double() - c).abs().max().item()
        assert err <= 3 * err_ref + 1e-3, (name, err, err_ref)


def test_cuda_attention_runs_on_a_side_stream_and_under_compile():
    row = treecp.Row.from_segments([-1, 0, 0], [200, 100, 50])
    key = tt.plan(row)
    q, k, v = (torch.randn(row.tokens, h, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    ref, _ = tt.attention(q, k, v, key)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        o, _ = tt.attention(q, k, v, key)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    compiled = torch.compile(lambda q, k, v: tt.attention(q, k, v, key)[0], fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), ref, rtol=0, atol=0)
