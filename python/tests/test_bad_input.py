"""Every bad input raises ValueError (TypeError for a non-key) naming the argument, before anything runs."""

import re

import pytest
import torch

import treecp
import treecp.torch as tt

ROW = treecp.Row.from_segments([-1, 0, 0], [4, 3, 2])


@pytest.fixture(scope="module")
def key():
    return tt.plan(ROW)


def qkv(n=9, hq=4, hkv=2, d=8, dv=8, dtype=torch.float64):
    return torch.randn(n, hq, d, dtype=dtype), torch.randn(n, hkv, d, dtype=dtype), torch.randn(n, hkv, dv, dtype=dtype)


@pytest.mark.parametrize("case,needle", [
    (lambda q, k, v: (q.float(), k, v, None), "k has dtype torch.float64 but q has torch.float32"),
    (lambda q, k, v: (q.half(), k.half(), v.half(), None), "q has dtype torch.float16; on CPU"),
    (lambda q, k, v: (q.to(torch.int64), k, v, None), "q has dtype torch.int64"),
    (lambda q, k, v: (q[:5], k, v, None), r"q has shape \(5, 4, 8\); its first dimension must be 9"),
    (lambda q, k, v: (q, k[:, :, :4], v, None), r"k has shape \[9, 2, 4\], expected \[9, 2, 8\]"),
    (lambda q, k, v: (q, k[:, :1].expand(9, 3, 8), v, None), "k has 3 heads, which must divide q's 4"),
    (lambda q, k, v: (q.flatten(1), k, v, None), "q must be token-major"),
    (lambda q, k, v: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None), "q has strides"),
    (lambda q, k, v: (q, k, v, torch.zeros(3, dtype=torch.float64)), r"sink has shape \[3\], expected \[4\]"),
    (lambda q, k, v: (q, k, v, torch.zeros(4)), "sink has dtype torch.float32"),
    (lambda q, k, v: (q, k, v.to("meta"), None), "v is on meta but q is on cpu"),
    (lambda q, k, v: (q.to("meta"), k.to("meta"), v.to("meta"), None), "q is on meta"),
    (lambda q, k, v: ([1.0], k, v, None), "q must be a torch.Tensor"),
])
def test_attention_refuses_bad_input(key, case, needle):
    q, k, v, sink = case(*qkv())
    with pytest.raises(ValueError, match=needle):
        tt.attention(q, k, v, key, sink=sink)


def test_attention_refuses_bad_scale_and_key(key):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
        tt.attention(q, k, v, key, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="key must be a treecp.torch.Key"):
        tt.attention(q, k, v, ROW)


def test_a_key_from_another_row_or_group_size_is_refused(key):
    other = tt.plan(treecp.Row.from_segments([-1, 0], [4, 4]))
    q, k, v = qkv()
    with pytest.raises(ValueError, match="first dimension must be 8"):
        tt.attention(q, k, v, other)
    with pytest.raises(ValueError, match=r"x has shape \(9, 3\); its first dimension must be 8 \(tokens of the row\)"):
        other.dispatch(torch.zeros(9, 3))
    with pytest.raises(ValueError, match="first dimension must be 9 .tokens this rank owns"):
        key.undispatch(torch.zeros(8, 3))


CUDA_DIMS_MESSAGE = (r"on CUDA the head dims \(D of q and k, Dv of v\) must be one of \(D, Dv\) \(64, 64\), "
                     r"\(128, 128\), \(192, 128\), \(256, 256\), got \(%d, %d\)")


def test_the_cuda_head_dims_come_from_the_kernels_table_in_every_build():
    # the extension answers from kernels/cuda/attention_dims.hpp whether or not it was built with CUDA
    assert treecp._core.cuda_attention_dims == ((64, 64), (128, 128), (192, 128), (256, 256))
    assert tt.CUDA_ATTENTION_DIMS == treecp._core.cuda_attention_dims
    from treecp.torch._ops import _cuda_attention_dims_problem
    for d, dv in tt.CUDA_ATTENTION_DIMS:
        assert _cuda_attention_dims_problem("attention", d, dv) is None
    # pairs the kernels lack (MLA's 192 with a Dv of 192, Dv 128 beside D 256, ...): refused, the list in the message
    for d, dv in ((192, 192), (128, 192), (256, 128), (64, 128), (128, 64), (8, 8), (96, 96)):
        problem = _cuda_attention_dims_problem("attention", d, dv)
        assert problem is not None and problem.startswith("attention: "), (d, dv)
        assert re.search(CUDA_DIMS_MESSAGE % (d, dv), problem), problem


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU on this machine")
def test_cuda_tensors_are_refused_by_name_where_the_kernels_cannot_take_them(key):
    q, k, v = (x.cuda().bfloat16() for x in qkv())  # head dim 8
    if not treecp._core.has_cuda_backend:
        with pytest.raises(ValueError, match="q is on cuda.*no CUDA backend"):
            tt.attention(q, k, v, key)
        return
    with pytest.raises(ValueError, match=CUDA_DIMS_MESSAGE % (8, 8)):
        tt.attention(q, k, v, key)
    # pairs the kernels lack, Dv != D among them, are refused with the list (MLA's (192, 128) itself is taken)
    for d, dv in ((192, 192), (128, 64), (256, 128)):
        q, k, v = (x.cuda().bfloat16() for x in qkv(d=d, dv=dv))
        with pytest.raises(ValueError, match=CUDA_DIMS_MESSAGE % (d, dv)):
            tt.attention(q, k, v, key)
    # attention takes bfloat16 or float16, q, k, v and sink in one of them; float32 and mixtures are refused by name
    q, k, v = (x.cuda() for x in qkv(d=64, dv=64, dtype=torch.float16))
    with pytest.raises(ValueError, match="q has dtype torch.float32; on CUDA treecp takes bfloat16 or float16"):
        tt.attention(q.float(), k.float(), v.float(), key)
    with pytest.raises(ValueError, match="k has dtype torch.bfloat16 but q has torch.float16"):
        tt.attention(q, k.bfloat16(), v, key)
    with pytest.raises(ValueError, match="v has dtype torch.float16 but q has torch.bfloat16"):
        tt.attention(q.bfloat16(), k.bfloat16(), v, key)
    with pytest.raises(ValueError, match="sink has dtype torch.bfloat16 but q has torch.float16"):
        tt.attention(q, k, v, key, sink=torch.zeros(4, device="cuda", dtype=torch.bfloat16))
    # GDN/KDA and the short convolution take bfloat16 or float16 too, every tensor in one of them
    x = torch.randn(9, 4, device="cuda")
    with pytest.raises(ValueError, match="x has dtype torch.float32; on CUDA treecp takes bfloat16 or float16"):
        tt.short_conv(x, torch.randn(4, 3, device="cuda"), key)
    with pytest.raises(ValueError, match="weight has dtype torch.bfloat16 but x has torch.float16"):
        tt.short_conv(x.half(), torch.randn(4, 3, device="cuda", dtype=torch.bfloat16), key)
    h = torch.randn(9, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="beta has dtype torch.bfloat16 but q has torch.float16"):
        tt.gated_delta_rule(h, h, h, -torch.rand(9, 2, device="cuda").half(), torch.rand(9, 2, device="cuda").bfloat16(),
                            key)
    with pytest.raises(ValueError, match="precision 'bf16_tensor' needs bfloat16 inputs, got torch.float16"):
        tt.gated_delta_rule(h, h, h, -torch.rand(9, 2, device="cuda").half(), torch.rand(9, 2, device="cuda").half(),
                            key, precision="bf16_tensor")
    with pytest.raises(ValueError, match="weight's width .* must be in \\[1, 64\\], got 65"):
        tt.short_conv(x.bfloat16(), torch.randn(4, 65, device="cuda", dtype=torch.bfloat16), key)


def test_gdn_refuses_bad_input(key):
    n, h, dk, dv = 9, 2, 4, 3
    q, k, v = torch.randn(n, h, dk, dtype=torch.float64), torch.randn(n, h, dk, dtype=torch.float64), \
        torch.randn(n, h, dv, dtype=torch.float64)
    g, beta = -torch.rand(n, h, dtype=torch.float64), torch.rand(n, h, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"g has shape \[9, 3\], expected \[9, 2\]"):
        tt.gated_delta_rule(q, k, v, -torch.rand(n, 3, dtype=torch.float64), beta, key)
    with pytest.raises(ValueError, match=r"GDN: \[tokens, H\]; KDA: \[tokens, H, K\]"):
        tt.gated_delta_rule(q, k, v, g[..., None, None], beta, key)
    with pytest.raises(ValueError, match="beta has dtype torch.float32"):
        tt.gated_delta_rule(q, k, v, g, beta.float(), key)
    with pytest.raises(ValueError, match="chunk_size must be in"):
        tt.gated_delta_rule(q, k, v, g, beta, key, chunk_size=0)
    with pytest.raises(ValueError, match="v has strides"):
        tt.gated_delta_rule(q, k, v.transpose(0, 1).contiguous().transpose(0, 1), g, beta, key)
    # precision names the CUDA kernels' products: a name outside the three is refused, and so is a bf16 path on CPU
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16_tensor, bf16_tensor_scans, got 'bf16'"):
        tt.gated_delta_rule(q, k, v, g, beta, key, precision="bf16")
    with pytest.raises(ValueError, match="precision 'bf16_tensor' chooses the CUDA kernels' products; on CPU"):
        tt.gated_delta_rule(q, k, v, g, beta, key, precision="bf16_tensor")
    # fla_split is a bool, and its arithmetic is bf16_tensor_scans' (which the CPU refuses above)
    with pytest.raises(ValueError, match="fla_split must be a bool, got int"):
        tt.gated_delta_rule(q, k, v, g, beta, key, fla_split=1)
    with pytest.raises(ValueError, match="fla_split runs every product on bf16 tensor cores: it needs "
                                         "precision='bf16_tensor_scans', got 'fp32'"):
        tt.gated_delta_rule(q, k, v, g, beta, key, fla_split=True)
    # fp32 is the CPU's own arithmetic: the same output as without the argument
    torch.testing.assert_close(tt.gated_delta_rule(q, k, v, g, beta, key, precision="fp32"),
                               tt.gated_delta_rule(q, k, v, g, beta, key), rtol=0, atol=0)


def test_short_conv_refuses_bad_input(key):
    x, w = torch.randn(9, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight has shape \[5, 4\], expected \[6, 4\]"):
        tt.short_conv(x, w[:5], key)
    with pytest.raises(ValueError, match=r"bias has shape \[2\], expected \[6\]"):
        tt.short_conv(x, w, key, bias=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="activation must be None or 'silu'"):
        tt.short_conv(x, w, key, activation="relu")
    with pytest.raises(ValueError, match="width .second dimension. must be in"):
        tt.short_conv(x, torch.randn(6, 65, dtype=torch.float64), key)


def test_plan_refuses_bad_arguments():
    with pytest.raises(ValueError, match="window: expected None or a positive int"):
        tt.plan(ROW, window=0)
    with pytest.raises(ValueError, match="layout: expected one of"):
        tt.plan(ROW, layout="diagonal")
    with pytest.raises(ValueError, match="costs: no coefficient file"):
        tt.plan(ROW, costs="/nonexistent.json")
    with pytest.raises(TypeError, match="row: expected a treecp.Row"):
        tt.plan([4, 3, 2])
    assert tt.plan(ROW, costs="cpu").plan.cp == 1


def _arrays(*shapes):
    return [torch.zeros(s, dtype=torch.float64) for s in shapes]


# The extension's own boundary (what torch.ops.treecp.* and any caller past the Python checks reach): every
# array is checked against the shape the core reads and writes through its pointer, so a wrong one is a
# ValueError naming it; before, the core read or wrote past the array's end (a crash or silent corruption).
@pytest.mark.parametrize("bad,needle", [
    ({"q": (8, 4, 8)}, r"attention_forward: q has shape \[8, 4, 8\], expected \[9, 4, 8\]"),
    ({"k": (9, 2, 4)}, r"attention_forward: k has shape \[9, 2, 4\], expected \[9, 2, 8\]"),
    ({"v": (9, 2, 6, 1)}, r"attention_forward: v has shape \[9, 2, 6, 1\], expected \[9, 2, 6\]"),
    ({"y": (9, 4, 5)}, r"attention_forward: y has shape \[9, 4, 5\], expected \[9, 4, 6\]"),
    ({"lse": (9,)}, r"attention_forward: lse has shape \[9\], expected \[9, 4\]"),
    ({"sink": (3,)}, r"attention_forward: sink has shape \[3\], expected \[4\]"),
    ({"o_presink": None}, "attention_forward: sink is given without o_presink"),
    ({"sink": None}, "attention_forward: sink is None but o_presink is given"),
])
def test_the_extension_refuses_arrays_of_another_shape(key, bad, needle):
    shapes = {"q": (9, 4, 8), "k": (9, 2, 8), "v": (9, 2, 6), "sink": (4,), "y": (9, 4, 6), "lse": (9, 4),
              "o_presink": (9, 4, 6)}
    shapes.update(bad)
    args = {name: None if s is None else _arrays(s)[0] for name, s in shapes.items()}
    with pytest.raises(ValueError, match=needle):
        key._core.attention_forward(4, 2, 8, 6, 0.5, args["q"], args["k"], args["v"], args["sink"], args["y"],
                                    args["lse"], args["o_presink"])


def test_the_extension_refuses_gradient_and_conv_arrays_of_another_shape(key):
    q, k, v, o, lse, dy, dq, dk, dv = _arrays((9, 4, 8), (9, 2, 8), (9, 2, 6), (9, 4, 6), (9, 4), (9, 4, 6),
                                              (9, 4, 8), (9, 2, 8), (9, 2, 5))
    with pytest.raises(ValueError, match=r"attention_backward: dv_ has shape \[9, 2, 5\], expected \[9, 2, 6\]"):
        key._core.attention_backward(4, 2, 8, 6, 0.5, q, k, v, None, o, lse, dy, dq, dk, dv, None)
    g, beta, y = _arrays((9, 2, 3), (9, 2), (9, 2, 6))
    with pytest.raises(ValueError, match=r"gdn_forward: g has shape \[9, 2, 3\], expected \[9, 2, 8\]"):
        key._core.gdn_forward(2, 8, 6, True, 0.5, 64, *_arrays((9, 2, 8), (9, 2, 8), (9, 2, 6)), g, beta, y)
    x, w, bias, out = _arrays((9, 6), (6, 4), (6,), (9, 6))
    with pytest.raises(ValueError, match=r"conv_forward: weight has shape \[6, 4\], expected \[6, 5\]"):
        key._core.conv_forward(6, 5, False, x, w, bias, out)
    with pytest.raises(ValueError, match=r"conv_backward: dx has shape \[8, 6\], expected \[9, 6\]"):
        key._core.conv_backward(6, 4, False, x, w, None, out, out[:8], w.clone(), None)
