"""GPU tests (bf16 on CUDA, one process): skipped without a GPU or when the build has no CUDA backend
(treecp._core.has_cuda_backend). Errors are bounded by the same-precision torch reference's own."""

import socket

import pytest
import torch
import torch.distributed as dist

import treecp
import treecp.torch as tt
from reference import dense_attention, random_row, visibility_mask
from treecp.torch import _comm

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


@pytest.fixture
def nccl_group():
    if not treecp._core.has_nccl:
        pytest.skip("this build of treecp has no NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = dist.group.WORLD
    try:
        yield group
    finally:
        for slot in [s for s in _comm._NCCL if s[0] is group]:
            del _comm._NCCL[slot]
        dist.destroy_process_group()


def test_attention_over_an_nccl_group_equals_the_op_without_one(nccl_group):
    dtype, d = torch.bfloat16, 64
    gen = torch.Generator().manual_seed(11)
    parents, lengths = random_row(gen, 10, 90)
    row = treecp.Row.from_segments(parents, lengths)
    key, grouped = tt.plan(row), tt.plan(row, group=nccl_group)
    t, hq, hkv = row.tokens, 8, 2
    # Refused before any collective: no communicator is made for bad input.
    bad = [torch.randn(t, h, d, device="cuda") for h in (hq, hkv, hkv)]
    with pytest.raises(ValueError, match="q has dtype torch.float32; on CUDA treecp takes bfloat16"):
        tt.attention(*bad, grouped)
    assert (nccl_group, 0) not in _comm._NCCL and grouped.nccl is None

    q, k, v = (torch.randn(t, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv))
    sink = torch.randn(hq, dtype=torch.float64, generator=gen)
    g = torch.randn(t, hq, d, dtype=torch.float64, generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, sink)]
    o64, _ = dense_attention(q, k, v, visibility_mask(parents, lengths, None), sink)
    truth = torch.autograd.grad((o64 * g).sum(), leaves)
    low = [x.detach().to(dtype).requires_grad_() for x in leaves]
    o_ref, _ = dense_attention(*low[:3], visibility_mask(parents, lengths, None), low[3])
    ref = torch.autograd.grad((o_ref * g.to(dtype)).sum(), low)

    def run(k_):
        dev = [x.detach().cuda().requires_grad_() for x in low]
        o, lse = tt.attention(*dev[:3], k_, sink=dev[3])
        return o, lse, torch.autograd.grad((o * g.to(dtype).cuda()).sum(), dev)

    o_a, lse_a, grads_a = run(key)
    o_b, lse_b, grads_b = run(grouped)
    assert isinstance(grouped.nccl, treecp._core.NcclCommunicator) and _comm._NCCL[(nccl_group, 0)] is grouped.nccl
    assert (grouped.nccl.rank, grouped.nccl.size, grouped.nccl.device) == (0, 1, 0)
    # One rank: the same plan and kernels, so the forward is bitwise the op's without a group.
    torch.testing.assert_close(o_b, o_a, rtol=0, atol=0)
    torch.testing.assert_close(lse_b, lse_a, rtol=0, atol=0)
    for name, a, b, r, c in zip(("o", "dq", "dk", "dv", "dsink"), (o_b,) + grads_b, (o_a,) + grads_a, (o_ref,) + ref,
                                (o64,) + truth):
        err_ref = (r.double() - c).abs().max().item()
        err = (a.double().cpu() - c).abs().max().item()
        assert err <= 3 * err_ref + 1e-3, (name, err, err_ref)
        # The backward's fp32 accumulation order may differ between runs; nothing else may.
        gap = (a.double() - b.double()).abs().max().item()
        assert gap <= err_ref, (name, gap, err_ref)

    # A second key of the group on the device reuses the communicator.
    again = grouped.with_window(40)
    o_w, _ = tt.attention(*(x.detach().cuda() for x in low[:3]), again)
    assert again.nccl is grouped.nccl and len([s for s in _comm._NCCL if s[0] is nccl_group]) == 1
    o_w_ref, _ = tt.attention(*(x.detach().cuda() for x in low[:3]), key.with_window(40))
    torch.testing.assert_close(o_w, o_w_ref, rtol=0, atol=0)
