"""treecp.torch ops on one process against independent torch references (dense masks and path recurrences
built from parent pointers), gradcheck in double, packed = flattened trajectories, torch.compile."""

import pytest
import torch

import treecp
import treecp.torch as tt
from reference import conv_tree, dense_attention, gdn_tree, random_row, visibility_mask

ROWS = [
    ([-1, 0, 0], [4, 3, 2]),                # DESIGN.md's example
    ([-1, 0, 1, 1, 0, -1, 5], [5, 3, 2, 4, 1, 3, 2]),  # two families, depth 3
]


def rand(*shape, dtype=torch.float64, gen=None, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, generator=gen).requires_grad_(requires_grad)


def assert_same_gradients(out, ref, leaves, gen, tol):
    """Gradients of a random linear function of `out` and of `ref` with respect to `leaves` agree."""
    w = rand(*out.shape, gen=gen)
    for a, b in zip(torch.autograd.grad((out * w).sum(), leaves), torch.autograd.grad((ref * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def attention_inputs(t, hq, hkv, d, dv, dtype, gen):
    return (rand(t, hq, d, dtype=dtype, gen=gen), rand(t, hkv, d, dtype=dtype, gen=gen),
            rand(t, hkv, dv, dtype=dtype, gen=gen), rand(hq, dtype=dtype, gen=gen))


@pytest.mark.parametrize("parents,lengths", ROWS)
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sink", [False, True])
def test_attention_matches_dense_reference_and_gradients(parents, lengths, window, with_sink):
    gen = torch.Generator().manual_seed(7)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row, window=window)
    q, k, v, sink = attention_inputs(row.tokens, 4, 2, 8, 6, torch.float64, gen)
    sink = sink if with_sink else None
    mask = visibility_mask(parents, lengths, window)
    leaves = [x.requires_grad_() for x in (q, k, v) + ((sink,) if with_sink else ())]
    o, lse = tt.attention(q, k, v, key, sink=sink)
    o_ref, lse_ref = dense_attention(q, k, v, mask, sink=sink)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    assert_same_gradients(o, o_ref, leaves, gen, 1e-11)


def test_attention_gradcheck_double():
    gen = torch.Generator().manual_seed(3)
    row = treecp.Row.from_segments([-1, 0, 0, 2], [3, 2, 2, 2])
    key = tt.plan(row, window=4)
    q, k, v, sink = attention_inputs(row.tokens, 2, 1, 3, 2, torch.float64, gen)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, sink))
    assert torch.autograd.gradcheck(lambda q, k, v, s: tt.attention(q, k, v, key, sink=s, softmax_scale=0.7)[0],
                                    inputs)


def test_attention_float32_error_is_bounded_by_a_float32_reference():
    gen = torch.Generator().manual_seed(11)
    parents, lengths = random_row(gen, 12, 9)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row, window=7)
    mask = visibility_mask(parents, lengths, 7)
    q, k, v, sink = attention_inputs(row.tokens, 4, 1, 16, 16, torch.float64, gen)
    truth, _ = dense_attention(q, k, v, mask, sink)
    f32 = [x.float() for x in (q, k, v, sink)]
    ref32, _ = dense_attention(*f32[:3], mask, f32[3])
    got, _ = tt.attention(*f32[:3], key, sink=f32[3])
    assert got.dtype == torch.float32
    err_ref = (ref32.double() - truth).abs().max().item()
    err = (got.double() - truth).abs().max().item()
    assert err <= 4 * err_ref + 1e-6, (err, err_ref)


@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128)])
def test_attention_with_v_narrower_or_wider_than_q_matches_the_reference_on_cpu(d, dv):
    # MLA's dense form (q, k 192 wide, v 128) and the reverse on the CPU path: the output and every gradient against
    # the dense float64 reference and its autograd (the gradcheck above takes D 3, Dv 2 by finite differences); float32
    # within what a float32 reference differs from float64.
    gen = torch.Generator().manual_seed(17)
    parents, lengths = random_row(gen, 6, 7)
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row, window=5)
    mask = visibility_mask(parents, lengths, 5)
    q, k, v, sink = attention_inputs(row.tokens, 4, 2, d, dv, torch.float64, gen)
    leaves = [x.requires_grad_() for x in (q, k, v, sink)]
    o, lse = tt.attention(q, k, v, key, sink=sink)
    o_ref, lse_ref = dense_attention(q, k, v, mask, sink=sink)
    assert o.shape == (row.tokens, 4, dv) and lse.shape == (row.tokens, 4)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    w = rand(*o.shape, gen=gen)
    truth = torch.autograd.grad((o_ref * w).sum(), leaves)
    got = torch.autograd.grad((o * w).sum(), leaves)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, truth):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    f32 = [x.detach().float().requires_grad_() for x in leaves]
    o32_ref, _ = dense_attention(*f32[:3], mask, f32[3])
    ref32 = (o32_ref,) + torch.autograd.grad((o32_ref * w.float()).sum(), f32)
    f32_op = [x.detach().clone().requires_grad_() for x in f32]
    o32, _ = tt.attention(*f32_op[:3], key, sink=f32_op[3])
    got32 = (o32,) + torch.autograd.grad((o32 * w.float()).sum(), f32_op)
    for name, a, b, c in zip(("o", "dq", "dk", "dv", "dsink"), got32, ref32, (o_ref,) + truth):
        assert a.dtype == torch.float32, name
        err = (a.double() - c).abs().max().item()
        err_ref = (b.double() - c).abs().max().item()
        assert err <= 4 * err_ref + 1e-6, (name, err, err_ref)


def test_packed_equals_flattened_trajectories():
    # Each trajectory alone (a row of one segment) gives the same outputs and summed gradients as the tree.
    gen = torch.Generator().manual_seed(5)
    trajs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [4, 4, 4, 4]]
    packed = treecp.Row.from_trajectories(trajs)
    key = tt.plan(packed.row, window=4)
    vocab, hq, hkv, d = 10, 2, 1, 4
    wq, wk, wv = (rand(vocab, h * d, gen=gen, requires_grad=True) for h in (hq, hkv, hkv))
    sink = rand(hq, gen=gen, requires_grad=True)

    def run(tokens, key):
        ids = torch.as_tensor(tokens)
        o, _ = tt.attention(wq[ids].view(-1, hq, d), wk[ids].view(-1, hkv, d), wv[ids].view(-1, hkv, d), key,
                            sink=sink)
        return o

    o_tree = run(packed.tokens, key)
    # loss: every trajectory's outputs, summed with fixed weights (shared tokens count once per trajectory)
    weights = [rand(len(t), hq, d, gen=gen) for t in trajs]
    loss_tree = sum((o_tree[torch.as_tensor(i)] * w).sum() for i, w in zip(packed.index, weights))
    g_tree = torch.autograd.grad(loss_tree, (wq, wk, wv, sink))
    loss_flat = 0
    for t, i, w in zip(trajs, packed.index, weights):
        o_flat = run(t, tt.plan(treecp.Row.from_segments([-1], [len(t)]), window=4))
        torch.testing.assert_close(o_flat, o_tree[torch.as_tensor(i)], rtol=1e-12, atol=1e-12)
        loss_flat = loss_flat + (o_flat * w).sum()
    g_flat = torch.autograd.grad(loss_flat, (wq, wk, wv, sink))
    for a, b in zip(g_tree, g_flat):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("kda", [False, True])
def test_gated_delta_rule_matches_tree_recurrence(kda):
    gen = torch.Generator().manual_seed(21 + kda)
    parents, lengths = [-1, 0, 1, 0, -1], [7, 5, 3, 6, 4]
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    t, h, dk, dv = row.tokens, 2, 4, 3
    q, k = rand(t, h, dk, gen=gen), torch.nn.functional.normalize(rand(t, h, dk, gen=gen), dim=-1)
    v = rand(t, h, dv, gen=gen)
    g = -torch.rand(*((t, h, dk) if kda else (t, h)), dtype=torch.float64, generator=gen)
    beta = torch.rand(t, h, dtype=torch.float64, generator=gen)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    y = tt.gated_delta_rule(q, k, v, g, beta, key, chunk_size=4)
    y_ref = gdn_tree(q, k, v, g, beta, parents, lengths, scale=dk ** -0.5)  # FLA's default scale
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    assert_same_gradients(y, y_ref, leaves, gen, 1e-9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gated_delta_rule_keep_for_backward_hands_the_forward_run_over(dtype):
    """keep_for_backward=True: the forward keeps its run (one per call), the backward takes it instead of running the
    forward again, and the gradients are the recomputing backward's bit for bit (the same arithmetic, in the same
    order); a graph dropped without its backward drops its run; no_grad keeps nothing."""
    import gc
    gen = torch.Generator().manual_seed(31)
    parents, lengths = [-1, 0, 1, 0, -1], [9, 5, 3, 6, 4]
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    t, h, dk, dv = row.tokens, 2, 4, 3
    base = (rand(t, h, dk, gen=gen), torch.nn.functional.normalize(rand(t, h, dk, gen=gen), dim=-1),
            rand(t, h, dv, gen=gen), -torch.rand(t, h, dtype=torch.float64, generator=gen),
            torch.rand(t, h, dtype=torch.float64, generator=gen))
    w = rand(t, h, dv, gen=gen).to(dtype)
    grads = {}
    for keep in (False, True):
        leaves = [x.to(dtype).requires_grad_() for x in base]
        y = tt.gated_delta_rule(*leaves, key, chunk_size=4, keep_for_backward=keep)
        assert key._core.gdn_saved_count() == int(keep)
        grads[keep] = (y.detach(), *torch.autograd.grad((y * w).sum(), leaves))
        assert key._core.gdn_saved_count() == 0  # taken by the backward
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)
    y_ref = gdn_tree(*(x.to(dtype) for x in base), parents, lengths, scale=dk ** -0.5)
    torch.testing.assert_close(grads[True][0], y_ref, rtol=1e-5, atol=1e-5)
    leaves = [x.to(dtype).requires_grad_() for x in base]
    y = tt.gated_delta_rule(*leaves, key, chunk_size=4, keep_for_backward=True)
    assert key._core.gdn_saved_count() == 1
    del y
    gc.collect()
    tt.gated_delta_rule(*(x.detach() for x in leaves), key, chunk_size=4)  # a call frees what was dropped
    assert key._core.gdn_saved_count() == 0
    with torch.no_grad():
        tt.gated_delta_rule(*leaves, key, chunk_size=4, keep_for_backward=True)
    assert key._core.gdn_saved_count() == 0
    with pytest.raises(ValueError, match="keep_for_backward must be a bool, got int"):
        tt.gated_delta_rule(*leaves, key, keep_for_backward=1)


def test_gated_delta_rule_gradcheck_double():
    gen = torch.Generator().manual_seed(2)
    row = treecp.Row.from_segments([-1, 0, 0], [3, 2, 2])
    key = tt.plan(row)
    t, h, dk, dv = row.tokens, 1, 2, 2
    inputs = (rand(t, h, dk, gen=gen), rand(t, h, dk, gen=gen) * 0.5, rand(t, h, dv, gen=gen),
              -torch.rand(t, h, dtype=torch.float64, generator=gen), torch.rand(t, h, dtype=torch.float64, generator=gen))
    inputs = tuple(x.requires_grad_() for x in inputs)
    assert torch.autograd.gradcheck(lambda *a: tt.gated_delta_rule(*a, key, chunk_size=2), inputs)


@pytest.mark.parametrize("silu", [False, True])
def test_short_conv_matches_path_convolution(silu):
    gen = torch.Generator().manual_seed(4)
    parents, lengths = [-1, 0, 1, 1, 0], [3, 1, 2, 4, 5]
    row = treecp.Row.from_segments(parents, lengths)
    key = tt.plan(row)
    x, w, b = rand(row.tokens, 6, gen=gen), rand(6, 4, gen=gen), rand(6, gen=gen)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    y = tt.short_conv(x, w, key, bias=b, activation="silu" if silu else None)
    y_ref = conv_tree(x, w, b, parents, lengths, silu)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    assert_same_gradients(y, y_ref, leaves, gen, 1e-11)
    assert torch.autograd.gradcheck(lambda x, w, b: tt.short_conv(x, w, key, bias=b, activation="silu"), leaves)


def test_dispatch_then_undispatch_is_the_identity_on_one_rank():
    row = treecp.Row.from_segments([-1, 0, 0], [4, 3, 2])
    key = tt.plan(row)
    x = torch.randn(row.tokens, 3, 2)
    assert torch.equal(key.undispatch(key.dispatch(x)), x)
    assert key.position_ids().tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5]


class TinyBlock(torch.nn.Module):
    """Projections, RoPE-free attention with a sink, a short conv and a GDN mixer: every op under compile."""

    def __init__(self, key, c=8, h=2, d=4):
        super().__init__()
        self.key, self.h, self.d = key, h, d
        self.qkv = torch.nn.Linear(c, 3 * h * d, dtype=torch.float64)
        self.sink = torch.nn.Parameter(torch.zeros(h, dtype=torch.float64))
        self.conv = torch.nn.Parameter(torch.randn(h * d, 3, dtype=torch.float64))
        self.gate = torch.nn.Linear(c, 2 * h, dtype=torch.float64)

    def forward(self, x):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.h, self.d).unbind(1)
        o, _ = tt.attention(q.contiguous(), k.contiguous(), v.contiguous(), self.key, sink=self.sink)
        kc = tt.short_conv(k.reshape(n, -1).contiguous(), self.conv, self.key, activation="silu").view(n, self.h, self.d)
        g, beta = self.gate(x).view(n, 2, self.h).unbind(1)
        y = tt.gated_delta_rule(q.contiguous(), torch.nn.functional.normalize(kc, dim=-1).contiguous(), v.contiguous(),
                                torch.nn.functional.logsigmoid(g).contiguous(), beta.sigmoid().contiguous(), self.key)
        return (o + y).reshape(n, -1)


def test_torch_compile_fullgraph_traces_a_model():
    torch.manual_seed(0)
    row = treecp.Row.from_segments([-1, 0, 0], [5, 3, 4])
    key = tt.plan(row, window=6)
    model = TinyBlock(key)
    x = torch.randn(row.tokens, 8, dtype=torch.float64)
    eager = model(key.dispatch(x))
    eager_grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    # aot_eager traces forward and backward through the fake implementations without inductor codegen.
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(key.dispatch(x))
    torch.testing.assert_close(out, eager, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.square().sum(), list(model.parameters())), eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_torch_compile_takes_head_dims_that_change_between_calls():
    # A recompilation for a new head dim makes that dim symbolic, and with it the default scale 1/sqrt(D): the checks
    # once tested it with math.isfinite, which dynamo cannot trace ("torch.* op returned non-Tensor"). Each call,
    # forward and gradients, equals the dense oracle at that head dim's default scale.
    row = treecp.Row.from_segments([-1, 0, 0], [6, 4, 3])
    key = tt.plan(row)
    mask = visibility_mask(row.parents, row.lengths, None)
    attn = torch.compile(lambda q, k, v: tt.attention(q, k, v, key)[0].square().sum(), fullgraph=True,
                         backend="aot_eager")
    gdn = torch.compile(lambda q, k, v, g, b: tt.gated_delta_rule(q, k, v, g, b, key).square().sum(), fullgraph=True,
                        backend="aot_eager")
    gen = torch.Generator().manual_seed(12)
    for d in (4, 6, 8):
        q, k, v, _ = attention_inputs(row.tokens, 4, 2, d, d, torch.float64, gen)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        loss = attn(*leaves)
        o, _ = dense_attention(q, k, v, mask)
        torch.testing.assert_close(loss, o.square().sum(), rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(o.square().sum(), leaves)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        x = [rand(row.tokens, 2, d, gen=gen) for _ in range(3)]
        g, b = -rand(row.tokens, 2, gen=gen).abs(), rand(row.tokens, 2, gen=gen).sigmoid()
        ref = gdn_tree(*x, g, b, row.parents, row.lengths, scale=d ** -0.5)
        torch.testing.assert_close(gdn(*x, g, b), ref.square().sum(), rtol=1e-10, atol=1e-10)


def test_torch_compile_takes_a_second_key_through_the_same_code():
    # A recompilation for another key must keep the key a constant of the graph (an int id became a SymInt that
    # could not name its key: "unhashable type: non-nested SymInt" in the autograd setup).
    step = torch.compile(lambda q, k, v, key: tt.attention(q, k, v, key)[0].square().sum(), fullgraph=True,
                         backend="aot_eager")
    gen = torch.Generator().manual_seed(11)
    for parents, lengths in ROWS:
        row = treecp.Row.from_segments(parents, lengths)
        key = tt.plan(row)
        q, k, v, _ = attention_inputs(row.tokens, 4, 2, 8, 8, torch.float64, gen)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        got = torch.autograd.grad(step(*leaves, key), leaves)
        o, _ = dense_attention(q, k, v, visibility_mask(row.parents, row.lengths, None))
        for a, b in zip(got, torch.autograd.grad(o.square().sum(), leaves)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_custom_ops_pass_torch_library_opcheck():
    row = treecp.Row.from_segments([-1, 0], [3, 2])
    key = tt.plan(row)
    q, k, v, s = (rand(5, 2, 3), rand(5, 1, 3), rand(5, 1, 2), rand(2))
    for x in (q, k, v, s):
        x.requires_grad_()
    torch.library.opcheck(torch.ops.treecp.attention.default, (q, k, v, s, key.id, 0.5))
    x, w = rand(5, 4, requires_grad=True), rand(4, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.treecp.short_conv.default, (x, w, None, key.id, True))
    gen = torch.Generator().manual_seed(5)
    qd, kd, vd = (torch.randn(5, 2, 4, generator=gen, requires_grad=True) for _ in range(3))
    g = (-torch.rand(5, 2, generator=gen)).requires_grad_()
    beta = torch.rand(5, 2, generator=gen).requires_grad_()
    torch.library.opcheck(torch.ops.treecp.gated_delta_rule.default,
                          (qd, kd, vd, g, beta, key.id, 0.5, 64, "fp32", False, False))


def test_a_key_for_another_window_keeps_the_ownership():
    row = treecp.Row.from_segments([-1, 0, 1, 0], [6, 4, 3, 5])
    key = tt.plan(row)
    windowed = key.with_window(3)
    assert windowed.window == 3 and torch.equal(windowed.index, key.index)
    q, k, v, _ = attention_inputs(row.tokens, 2, 2, 4, 4, torch.float64, torch.Generator().manual_seed(8))
    o, _ = tt.attention(q, k, v, windowed)
    o_ref, _ = dense_attention(q, k, v, visibility_mask(row.parents, row.lengths, 3))
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)


class _RecordingCore:
    """Stands in for a key's extension object: records, per call, which tensors it is handed that require
    grad (at call time: outputs it fills become autograd outputs afterwards), then delegates."""

    def __init__(self, core):
        self.core, self.calls, self.requiring_grad = core, set(), []

    def __getattr__(self, name):
        target = getattr(self.core, name)

        def call(*args):
            self.calls.add(name)
            self.requiring_grad += [(name, i) for i, a in enumerate(args)
                                    if isinstance(a, torch.Tensor) and a.requires_grad]
            return target(*args)
        return call if callable(target) else target


def test_every_tensor_reaches_the_extension_detached():
    # torch's __dlpack__ refuses tensors that require grad; whether the extension then imports them depends
    # on nanobind's fallbacks (older versions raise TypeError), so no op may rely on it, backward included.
    gen = torch.Generator().manual_seed(3)
    row = treecp.Row.from_segments([-1, 0, 0], [4, 3, 2])
    key = tt.plan(row)
    key._core = recorder = _RecordingCore(key._core)
    q, k, v = (rand(9, h, 8, gen=gen, requires_grad=True) for h in (4, 2, 2))
    sink = torch.nn.Parameter(rand(4, gen=gen))
    o, _ = tt.attention(q, k, v, key, sink=sink)
    g, beta = (-rand(9, 2, 8, gen=gen).abs()).requires_grad_(), rand(9, 2, gen=gen).sigmoid().requires_grad_()
    y = tt.gated_delta_rule(k, k, v, g, beta, key)
    conv = torch.nn.Conv1d(16, 16, 3, groups=16, dtype=torch.float64)
    z = tt.short_conv(v.flatten(1) * 1.0, conv.weight.squeeze(1), key, bias=conv.bias, activation="silu")
    (o.sum() + y.sum() + z.sum()).backward()
    assert recorder.calls >= {"attention_forward", "attention_backward", "gdn_forward", "gdn_backward",
                              "conv_forward", "conv_backward"}
    assert recorder.requiring_grad == []
    assert all(x.grad is not None for x in (q, k, v, sink, g, beta, conv.weight, conv.bias))
