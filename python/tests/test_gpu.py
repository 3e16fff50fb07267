"""GPU tests (bf16 and, for attention, fp16 on CUDA, one process): skipped without a GPU or when the build has no
CUDA backend (treecp._core.has_cuda_backend). Errors are bounded by the same-precision torch reference's own."""

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


# The absolute slack of the bound below is bf16's; fp16's unit roundoff (2^-11) is 8 times smaller than bf16's (2^-8).
ATTENTION_ATOL = {torch.bfloat16: 1e-3, torch.float16: 1e-3 * 2.0 ** -3}


# Every (D, Dv) pair of the kernels' table (tt.CUDA_ATTENTION_DIMS), MLA's dense form (192, 128) included.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("window", [None, 90])
def test_attention_on_cuda_is_as_accurate_as_torch_in_the_same_precision(d, dv, window, dtype):
    gen = torch.Generator().manual_seed(5)
    parents, lengths = random_row(gen, 12, 100)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row, window=window)
    t, hq, hkv = row.tokens, 8, 2
    q, k = (torch.randn(t, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv))
    v = torch.randn(t, hkv, dv, dtype=torch.float64, generator=gen)
    sink = torch.randn(hq, dtype=torch.float64, generator=gen)
    g = torch.randn(t, hq, dv, dtype=torch.float64, generator=gen)
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
    assert o.shape == (t, hq, dv) and [g_.shape for g_ in got] == [x.shape for x in dev]
    for name, a, b, c in zip(("o", "dq", "dk", "dv", "dsink"), (o,) + got, (o_ref,) + ref, (o64,) + truth):
        err = (a.double().cpu() - c).abs().max().item()
        err_ref = (b.double() - c).abs().max().item()
        assert err <= 3 * err_ref + ATTENTION_ATOL[dtype], (name, err, err_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,dv", [(64, 64), (192, 128)])
def test_cuda_attention_runs_on_a_side_stream_and_under_compile(d, dv, dtype):
    # (192, 128): the fake implementation's output is [n, Hq, Dv] as the CUDA op's is
    row = treecp.Row.from_segments([-1, 0, 0], [200, 100, 50])
    key = tt.plan(row)
    q, k, v = (torch.randn(row.tokens, h, w, device="cuda", dtype=dtype) for h, w in ((4, d), (2, d), (2, dv)))
    ref, _ = tt.attention(q, k, v, key)
    assert ref.dtype == dtype
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        o, _ = tt.attention(q, k, v, key)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    compiled = torch.compile(lambda q, k, v: tt.attention(q, k, v, key)[0], fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), ref, rtol=0, atol=0)
    # forward and backward through the compiled graph (the custom op's fake and autograd registrations) equal eager
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    eager = torch.autograd.grad(tt.attention(*leaves, key)[0].float().square().sum(), leaves)
    step = torch.compile(lambda q, k, v: tt.attention(q, k, v, key)[0].float().square().sum(), fullgraph=True,
                         backend="aot_eager")
    got = torch.autograd.grad(step(*leaves), leaves)
    for a, b in zip(got, eager):  # dQ is summed by atomics: equal up to the order of its fp32 adds
        assert a.dtype == dtype
        torch.testing.assert_close(a, b)


def test_cuda_attention_takes_fp16_and_bf16_calls_of_one_key_in_turn():
    """One key (one cached backend) serves calls of both dtypes; each equals a fresh key's call of its dtype, and
    GDN after an fp16 attention call still runs in bf16."""
    row = treecp.Row.from_segments([-1, 0, 0], [150, 60, 40])
    key = tt.plan(row)
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(row.tokens, h, 128, generator=gen) for h in (8, 2, 2)]
    for dtype in (torch.float16, torch.bfloat16, torch.float16):
        qkv = [x.to(dtype).cuda() for x in base]
        o, lse = tt.attention(*qkv, key)
        fresh, fresh_lse = tt.attention(*qkv, tt.plan(row))
        assert o.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(o, fresh, rtol=0, atol=0)
        torch.testing.assert_close(lse, fresh_lse, rtol=0, atol=0)
    *inputs, _ = gdn_inputs(gen, row.tokens, 2, 64, 64, kda=False)
    y = tt.gated_delta_rule(*(x.cuda() for x in inputs), key)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


# ---------------------------------------------------------------- GDN / KDA and the short convolution
#
# Each CUDA result is checked against the same op on the CPU in float64 (the oracle) on the same inputs rounded to
# the CUDA dtype (bfloat16 or float16), normwise: error <= ERR_FACTOR x the error of the op run on the CPU in float32
# on those inputs + ATOL + ROUNDING[dtype] (what the CUDA op returns is rounded to its dtype: outputs and gradients
# alike; bf16 keeps 8 significant bits, fp16 11).
ERR_FACTOR = 8  # the device sums in another order than the CPU float32 run (tests/common/gdn_cuda.hpp's kErrFactor)
ATOL = 1e-6
ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def rel_err(a, b):
    return ((a.double().cpu() - b).norm() / b.norm()).item()


def gdn_inputs(gen, t, h, dk, dv, kda, dtype=torch.bfloat16):
    q = torch.randn(t, h, dk, dtype=torch.float64, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, dtype=torch.float64, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, dtype=torch.float64, generator=gen)
    g = -0.1 * torch.rand(*((t, h, dk) if kda else (t, h)), dtype=torch.float64, generator=gen)
    beta = torch.rand(t, h, dtype=torch.float64, generator=gen)
    w = torch.randn(t, h, dv, dtype=torch.float64, generator=gen)  # the loss's weights: dy
    return [x.to(dtype) for x in (q, k, v, g, beta, w)]


def run_op(op, inputs, w, device, dtype):
    """op(*inputs) and the gradients of sum(op * w) with respect to every input, computed on device in dtype."""
    leaves = [x.to(device=device, dtype=dtype).requires_grad_() for x in inputs]
    y = op(*leaves)
    return y, torch.autograd.grad((y * w.to(device=device, dtype=dtype)).sum(), leaves)


def check_against_cpu(names, got, f32, f64, dtype=torch.bfloat16):
    for name, a, b, c in zip(names, got, f32, f64):
        assert a.dtype == dtype and a.device.type == "cuda", (name, a.dtype, a.device)
        err, err_ref = rel_err(a, c), rel_err(b, c)
        assert err <= ERR_FACTOR * err_ref + ATOL + ROUNDING[dtype], (name, err, err_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kda,d", [(False, 64), (True, 128)])
def test_gated_delta_rule_on_cuda_is_as_accurate_as_the_cpu_op_in_float32(kda, d, dtype):
    gen = torch.Generator().manual_seed(23 + kda)
    parents, lengths = random_row(gen, 10, 90)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    *inputs, w = gdn_inputs(gen, row.tokens, 2, d, d, kda, dtype)

    def op(*a):
        return tt.gated_delta_rule(*a, key)

    got = run_op(op, inputs, w, "cuda", dtype)
    f32 = run_op(op, inputs, w, "cpu", torch.float32)
    f64 = run_op(op, inputs, w, "cpu", torch.float64)
    check_against_cpu(("y", "dq", "dk", "dv", "dg", "dbeta"), (got[0], *got[1]), (f32[0], *f32[1]), (f64[0], *f64[1]),
                      dtype)


@pytest.mark.parametrize("kda", [False, True])
def test_gated_delta_rule_precision_bf16_tensor_reaches_the_kernels(kda):
    """precision="bf16_tensor" runs the chunk products on tensor cores with bf16 operands: its result differs from
    the default fp32 products' and stays bf16-accurate. (The kernels' accuracy against a model of those roundings is
    tests/cuda's; here the bound is the fp32 path's plus four bf16 roundings, one per chained chunk product.)"""
    gen = torch.Generator().manual_seed(41 + kda)
    parents, lengths = random_row(gen, 10, 90)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    *inputs, w = gdn_inputs(gen, row.tokens, 2, 128, 128, kda)
    runs = {}
    for precision in ("fp32", "bf16_tensor"):
        runs[precision] = run_op(lambda *a: tt.gated_delta_rule(*a, key, precision=precision), inputs, w, "cuda",
                                 torch.bfloat16)
    f32 = run_op(lambda *a: tt.gated_delta_rule(*a, key), inputs, w, "cpu", torch.float32)
    f64 = run_op(lambda *a: tt.gated_delta_rule(*a, key), inputs, w, "cpu", torch.float64)
    assert not torch.equal(runs["fp32"][0], runs["bf16_tensor"][0])
    for precision, extra in (("fp32", 0.0), ("bf16_tensor", 4 * 2.0 ** -8)):
        got = runs[precision]
        for name, a, b, c in zip(("y", "dq", "dk", "dv", "dg", "dbeta"), (got[0], *got[1]), (f32[0], *f32[1]),
                                 (f64[0], *f64[1])):
            err, err_ref = rel_err(a, c), rel_err(b, c)
            assert err <= ERR_FACTOR * err_ref + ATOL + ROUNDING[torch.bfloat16] + extra, (precision, name, err, err_ref)


@pytest.mark.parametrize("kda", [False, True])
def test_gated_delta_rule_fla_split_reaches_the_kernels(kda):
    """fla_split=True (with precision="bf16_tensor_scans") runs the FLA-like split forward for GDN at K = V = 128: its
    y differs from the classic forward's at the same precision and stays bf16-accurate (the bound of the bf16 test
    above), and so do the gradients (the backward recomputes the states with the split); KDA's per-channel gate does
    not qualify, so there the result is the classic forward's, bit for bit."""
    gen = torch.Generator().manual_seed(43 + kda)
    parents, lengths = random_row(gen, 10, 90)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    *inputs, w = gdn_inputs(gen, row.tokens, 2, 128, 128, kda)
    runs = {}
    for split in (False, True):
        runs[split] = run_op(lambda *a: tt.gated_delta_rule(*a, key, precision="bf16_tensor_scans", fla_split=split),
                             inputs, w, "cuda", torch.bfloat16)
    f32 = run_op(lambda *a: tt.gated_delta_rule(*a, key), inputs, w, "cpu", torch.float32)
    f64 = run_op(lambda *a: tt.gated_delta_rule(*a, key), inputs, w, "cpu", torch.float64)
    if kda:
        assert torch.equal(runs[False][0], runs[True][0])
    else:
        assert not torch.equal(runs[False][0], runs[True][0])
    got = runs[True]
    for name, a, b, c in zip(("y", "dq", "dk", "dv", "dg", "dbeta"), (got[0], *got[1]), (f32[0], *f32[1]),
                             (f64[0], *f64[1])):
        err, err_ref = rel_err(a, c), rel_err(b, c)
        assert err <= ERR_FACTOR * err_ref + ATOL + ROUNDING[torch.bfloat16] + 4 * 2.0 ** -8, (name, err, err_ref)


@pytest.mark.parametrize("fla_split", [False, True])
def test_gated_delta_rule_keep_for_backward_on_cuda(fla_split):
    """keep_for_backward=True on CUDA (the classic kernels, and the split with its kept arrays): the forward keeps its
    run, the backward takes it, and y and every gradient are the recomputing backward's bit for bit."""
    gen = torch.Generator().manual_seed(47 + fla_split)
    parents, lengths = random_row(gen, 10, 90)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    *inputs, w = gdn_inputs(gen, row.tokens, 2, 128, 128, False)
    runs = {}
    for keep in (False, True):
        def op(*a):
            y = tt.gated_delta_rule(*a, key, precision="bf16_tensor_scans", fla_split=fla_split,
                                    keep_for_backward=keep)
            assert key._core.gdn_saved_count() == int(keep)
            return y
        runs[keep] = run_op(op, inputs, w, "cuda", torch.bfloat16)
        assert key._core.gdn_saved_count() == 0
    assert torch.equal(runs[False][0], runs[True][0])
    for a, b in zip(runs[False][1], runs[True][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("silu", [False, True])
def test_short_conv_on_cuda_is_as_accurate_as_the_cpu_op_in_float32(silu, dtype):
    gen = torch.Generator().manual_seed(31 + silu)
    parents, lengths = random_row(gen, 12, 40)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    c, width = 96, 4
    x, weight, bias, w = (torch.randn(*shape, dtype=torch.float64, generator=gen).to(dtype)
                          for shape in ((row.tokens, c), (c, width), (c,), (row.tokens, c)))

    def op(x, weight, bias):
        return tt.short_conv(x, weight, key, bias=bias, activation="silu" if silu else None)

    got = run_op(op, (x, weight, bias), w, "cuda", dtype)
    f32 = run_op(op, (x, weight, bias), w, "cpu", torch.float32)
    f64 = run_op(op, (x, weight, bias), w, "cpu", torch.float64)
    check_against_cpu(("y", "dx", "dweight", "dbias"), (got[0], *got[1]), (f32[0], *f32[1]), (f64[0], *f64[1]), dtype)


def test_cuda_gdn_and_conv_run_on_a_side_stream_and_under_compile():
    gen = torch.Generator().manual_seed(3)
    row = treecp.Row.from_segments([-1, 0, 0, 2], [150, 70, 40, 30])
    key = tt.plan(row)
    *inputs, w = gdn_inputs(gen, row.tokens, 2, 64, 64, kda=True)
    dev = [x.cuda() for x in inputs]
    weight = torch.randn(128, 4, generator=gen).to(torch.bfloat16).cuda()

    def layer(q, k, v, g, beta):
        y = tt.gated_delta_rule(q, k, v, g, beta, key)
        return tt.short_conv(y.flatten(1), weight, key, activation="silu")

    def with_grads(fn):
        leaves = [x.clone().requires_grad_() for x in dev]
        y = fn(*leaves)
        return (y, *torch.autograd.grad((y * w.cuda().flatten(1)).sum(), leaves))

    ref = with_grads(layer)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = with_grads(layer)
    torch.cuda.current_stream().wait_stream(side)
    compiled = with_grads(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    for got in (on_side, compiled):
        # The same kernels on the same inputs: the forward is bitwise the eager one's; the backward's fp32
        # accumulation order may differ, then its bf16 rounding by an ulp.
        torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
        for a, b in zip(got[1:], ref[1:]):
            torch.testing.assert_close(a, b)
    # The fake implementations agree with the CUDA ones (shapes, dtypes, autograd registration).
    torch.library.opcheck(torch.ops.treecp.gated_delta_rule.default,
                          (*dev, key.id, 0.125, 64, "fp32", False, False))
    torch.library.opcheck(torch.ops.treecp.short_conv.default, (dev[2].flatten(1), weight, None, key.id, True))


def test_cuda_gdn_and_conv_refuse_bad_input_by_name():
    row = treecp.Row.from_segments([-1, 0], [20, 10])
    key = tt.plan(row)
    t, h, d = row.tokens, 2, 64
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(t, h, d, **bf) for _ in range(3))
    g, beta = -torch.rand(t, h, **bf), torch.rand(t, h, **bf)
    with pytest.raises(ValueError, match="q has dtype torch.float32; on CUDA treecp takes bfloat16 or float16"):
        tt.gated_delta_rule(q.float(), k.float(), v.float(), g.float(), beta.float(), key)
    with pytest.raises(ValueError, match="k has dtype torch.float16 but q has torch.bfloat16"):
        tt.gated_delta_rule(q, k.half(), v, g, beta, key)
    with pytest.raises(ValueError, match="beta is on cpu but q is on cuda"):
        tt.gated_delta_rule(q, k, v, g, beta.cpu(), key)
    with pytest.raises(ValueError, match=r"beta has shape \[30, 3\], expected \[30, 2\]"):
        tt.gated_delta_rule(q, k, v, g, torch.rand(t, 3, **bf), key)
    wide = torch.randn(t, h, 300, **bf)
    with pytest.raises(ValueError, match="on CUDA the head dims must be at most 256, got q's 300"):
        tt.gated_delta_rule(wide, wide, v, -torch.rand(t, h, 300, **bf), beta, key)
    x = torch.randn(t, 8, **bf)
    with pytest.raises(ValueError, match="weight has dtype torch.float32 but x has torch.bfloat16"):
        tt.short_conv(x, torch.randn(8, 4, device="cuda"), key)
    with pytest.raises(ValueError, match=r"bias has shape \[9\], expected \[8\]"):
        tt.short_conv(x, torch.randn(8, 4, **bf), key, bias=torch.randn(9, **bf))
    assert key.cuda_device is None  # nothing refused reached the key's CUDA state
    # A key whose CUDA state is on another device (one made there: this machine may have one GPU, so the
    # key is bound by hand, as a first call on that device would).
    key.cuda_device = torch.device("cuda", 1)
    with pytest.raises(ValueError, match="q is on cuda:0 but this key's CUDA state is on cuda:1"):
        tt.gated_delta_rule(q, k, v, g, beta, key)
    with pytest.raises(ValueError, match="x is on cuda:0 but this key's CUDA state is on cuda:1"):
        tt.short_conv(x, torch.randn(8, 4, **bf), key)


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


def test_gdn_and_conv_over_an_nccl_group_equal_the_ops_without_one(nccl_group):
    gen = torch.Generator().manual_seed(13)
    parents, lengths = random_row(gen, 10, 70)
    row = treecp.Row.from_segments(parents, lengths)
    key, grouped = tt.plan(row), tt.plan(row, group=nccl_group)
    *inputs, w = gdn_inputs(gen, row.tokens, 2, 64, 64, kda=False)
    # Refused before any collective: no communicator is made for bad input.
    with pytest.raises(ValueError, match="q has dtype torch.float32; on CUDA treecp takes bfloat16"):
        tt.gated_delta_rule(*(x.float().cuda() for x in inputs), grouped)
    with pytest.raises(ValueError, match="x has dtype torch.float32; on CUDA treecp takes bfloat16"):
        tt.short_conv(torch.randn(row.tokens, 8, device="cuda"), torch.randn(8, 4, device="cuda"), grouped)
    assert (nccl_group, 0) not in _comm._NCCL and grouped.nccl is None

    def gdn(k_):
        return lambda *a: tt.gated_delta_rule(*a, k_)

    a, b = run_op(gdn(key), inputs, w, "cuda", torch.bfloat16), run_op(gdn(grouped), inputs, w, "cuda", torch.bfloat16)
    assert isinstance(grouped.nccl, treecp._core.NcclCommunicator) and _comm._NCCL[(nccl_group, 0)] is grouped.nccl
    f32, f64 = run_op(gdn(key), inputs, w, "cpu", torch.float32), run_op(gdn(key), inputs, w, "cpu", torch.float64)
    # One rank: the same plan and kernels, so the forward is bitwise the op's without a group.
    torch.testing.assert_close(b[0], a[0], rtol=0, atol=0)
    check_against_cpu(("y", "dq", "dk", "dv", "dg", "dbeta"), (b[0], *b[1]), (f32[0], *f32[1]), (f64[0], *f64[1]))

    c = 64
    x, weight, bias, wc = (torch.randn(*shape, dtype=torch.float64, generator=gen).to(torch.bfloat16)
                           for shape in ((row.tokens, c), (c, 4), (c,), (row.tokens, c)))

    def conv(k_):
        return lambda x, weight, bias: tt.short_conv(x, weight, k_, bias=bias, activation="silu")

    ca, cb = (run_op(conv(k_), (x, weight, bias), wc, "cuda", torch.bfloat16) for k_ in (key, grouped))
    c32, c64 = (run_op(conv(key), (x, weight, bias), wc, "cpu", dt) for dt in (torch.float32, torch.float64))
    torch.testing.assert_close(cb[0], ca[0], rtol=0, atol=0)
    check_against_cpu(("y", "dx", "dweight", "dbias"), (cb[0], *cb[1]), (c32[0], *c32[1]), (c64[0], *c64[1]))
    # The group's NCCL communicator served every op: still the one cached for (group, device).
    assert len([s for s in _comm._NCCL if s[0] is nccl_group]) == 1 and _comm._NCCL[(nccl_group, 0)] is grouped.nccl
