"""CP over a torch process group (gloo on localhost, 1-4 processes) equals CP1, in double precision.

Each rank computes the CP1 reference itself (a key without a group), then the same layers under CP; the
C++ protocol runs unchanged, its collectives calling torch.distributed. Checked on every rank: outputs,
gradients (this rank's contribution summed over the group = the CP1 gradient; GDN also with keep_for_backward,
whose backward takes the forward's run), dispatch/undispatch,
undispatch's adjoint, torch.compile(fullgraph=True) under CP, and that bad input on one rank is refused on
every rank with the group still usable.
"""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import treecp
import treecp.torch as tt

LAYOUTS = {1: "searched", 2: "searched", 3: "zigzag", 4: "contiguous"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sum(t, group=None):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _close(a, b, what, tol=1e-10):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1.0)
    assert err <= tol * scale, f"rank {dist.get_rank()}: {what} differs from CP1 by {err:.3e}"


def _attention_case(row, window, layout, group):
    gen = torch.Generator().manual_seed(17)
    t, hq, hkv, d = row.tokens, 4, 2, 8
    q, k, v = (torch.randn(t, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv))
    sink = torch.randn(hq, dtype=torch.float64, generator=gen)
    g = torch.randn(t, hq, d, dtype=torch.float64, generator=gen)
    results = {}
    for name, grp in (("cp1", None), ("cp", group)):
        # a windowed layer shares the unwindowed layer's ownership (with_window)
        key = tt.plan(row, group=grp, layout=layout)
        key = key.with_window(window) if window else key
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
        local = [key.dispatch(x) for x in leaves[:3]]
        o, lse = tt.attention(*local, key, sink=leaves[3])
        # Each rank's loss covers the tokens it owns: their sum over ranks is CP1's loss.
        (o * key.dispatch(g)).sum().backward()
        grads = [x.grad for x in leaves]
        if grp is not None:
            grads = [_sum(x, group) for x in grads]
        results[name] = (key.undispatch(o.detach()), key.undispatch(lse), grads, key)
    (o1, l1, g1, _), (o2, l2, g2, key) = results["cp1"], results["cp"]
    _close(o2, o1, "attention output")
    _close(l2, l1, "attention lse")
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), g2, g1):
        _close(a, b, name)
    return key, (q, k, v, sink)


def _gdn_conv_case(row, layout, group, kda):
    gen = torch.Generator().manual_seed(29)
    t, h, dk, dv, c = row.tokens, 2, 4, 3, 5
    full = [torch.randn(t, h, dk, dtype=torch.float64, generator=gen),
            torch.nn.functional.normalize(torch.randn(t, h, dk, dtype=torch.float64, generator=gen), dim=-1),
            torch.randn(t, h, dv, dtype=torch.float64, generator=gen),
            -torch.rand(*((t, h, dk) if kda else (t, h)), dtype=torch.float64, generator=gen),
            torch.rand(t, h, dtype=torch.float64, generator=gen)]
    x = torch.randn(t, c, dtype=torch.float64, generator=gen)
    w, b = torch.randn(c, 4, dtype=torch.float64, generator=gen), torch.randn(c, dtype=torch.float64, generator=gen)
    gy, gz = torch.randn(t, h, dv, dtype=torch.float64, generator=gen), torch.randn(t, c, dtype=torch.float64, generator=gen)
    results = {}
    # cp_kept: the GDN forward keeps its run for the backward (keep_for_backward), which then does not run it again
    for name, grp, keep in (("cp1", None, False), ("cp", group, False), ("cp_kept", group, True)):
        key = tt.plan(row, group=grp, layout=layout)
        leaves = [a.clone().requires_grad_() for a in full + [x, w, b]]
        y = tt.gated_delta_rule(*(key.dispatch(a) for a in leaves[:5]), key, chunk_size=4, keep_for_backward=keep)
        assert key._core.gdn_saved_count() == int(keep)
        z = tt.short_conv(key.dispatch(leaves[5]), leaves[6], key, bias=leaves[7], activation="silu")
        ((y * key.dispatch(gy)).sum() + (z * key.dispatch(gz)).sum()).backward()
        assert key._core.gdn_saved_count() == 0
        grads = [a.grad if grp is None else _sum(a.grad, group) for a in leaves]
        results[name] = (key.undispatch(y.detach()), key.undispatch(z.detach()), grads)
    y1, z1, g1 = results["cp1"]
    for cp in ("cp", "cp_kept"):
        y2, z2, g2 = results[cp]
        _close(y2, y1, f"{cp}: " + ("GDN output" if not kda else "KDA output"))
        _close(z2, z1, f"{cp}: short_conv output")
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dx", "dweight", "dbias"), g2, g1):
            _close(a, b, f"{cp}: {'KDA' if kda else 'GDN'}/conv {name}")


def _check_group(rank, n, group):
    layout = LAYOUTS[n]
    # One family over every rank (its root's KV must travel), a second family, depth 3.
    row = treecp.Row.from_segments([-1, 0, 1, 1, 0, 0, -1, 6], [40, 9, 7, 11, 13, 6, 10, 8])
    key, (q, k, v, sink) = _attention_case(row, None, layout, group)
    if layout in ("zigzag", "contiguous"):
        assert key.plan.num_waves > 0, "the root's KV must travel in this test"
    _attention_case(row, 12, "searched", group)
    _gdn_conv_case(row, layout, group, kda=False)
    _gdn_conv_case(row, "searched", group, kda=True)

    # dispatch then undispatch is the identity; owned rows partition the row
    x = torch.randn(row.tokens, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(key.undispatch(key.dispatch(x)), x)
    assert key.cp == n and int(_sum(torch.tensor([key.local_tokens]), group)) == row.tokens
    assert key.position_ids().tolist() == row.positions()[key.index.numpy()].tolist()
    # undispatch's backward is its exact adjoint: a loss computed on every rank from the gathered
    # tensor counts once per rank, so the summed gradient is n x the CP1 one.
    xl = key.dispatch(x).detach().requires_grad_()
    (key.undispatch(xl) * x).sum().backward()
    full = torch.zeros_like(x)
    full[key.index] = xl.grad
    _close(_sum(full, group), n * x, "undispatch adjoint")

    # bad input on one rank: every rank raises ValueError, and the group stays usable
    bad_rank = n - 1
    qq = key.dispatch(q)
    qq = qq.float() if rank == bad_rank else qq
    with pytest.raises(ValueError) as err:
        tt.attention(qq, key.dispatch(k), key.dispatch(v), key, sink=sink)
    msg = str(err.value)
    if rank == bad_rank:
        assert "k has dtype torch.float64 but q has torch.float32" in msg, msg
    else:
        assert f"bad input on rank {bad_rank}" in msg, msg
    o, _ = tt.attention(key.dispatch(q), key.dispatch(k), key.dispatch(v), key, sink=sink)
    assert o.shape[0] == key.local_tokens
    if n > 1:
        # keep_for_backward on one rank only: its backward would skip the forward's collectives the others run
        gen = torch.Generator().manual_seed(5)
        gd = [key.dispatch(torch.randn(row.tokens, 2, 4, dtype=torch.float64, generator=gen)).requires_grad_()
              for _ in range(3)]
        gate = key.dispatch(-torch.rand(row.tokens, 2, dtype=torch.float64, generator=gen))
        beta = key.dispatch(torch.rand(row.tokens, 2, dtype=torch.float64, generator=gen))
        with pytest.raises(ValueError, match="keep_for_backward .* holds on rank 0 only"):
            tt.gated_delta_rule(*gd, gate, beta, key, keep_for_backward=rank == 0)
        assert key._core.gdn_saved_count() == 0
        y = tt.gated_delta_rule(*gd, gate, beta, key, keep_for_backward=True)
        y.sum().backward()
        assert key._core.gdn_saved_count() == 0
    if n == 2:
        # torch.compile(fullgraph) of a function of the ops under CP: their collectives run inside the ops
        def layer(q, k, v, sink):
            o, _ = tt.attention(q, k, v, key, sink=sink)
            return tt.short_conv(o.flatten(1), torch.ones(o.shape[1] * o.shape[2], 3, dtype=o.dtype), key)

        args = [key.dispatch(x).detach().requires_grad_() for x in (q, k, v)] + [sink.clone().requires_grad_()]
        eager = layer(*args)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(*args)
        _close(compiled, eager, "compiled output")
        for a, b in zip(torch.autograd.grad(compiled.sum(), args), torch.autograd.grad(eager.sum(), args)):
            _close(a, b, "compiled gradient")
    # every rank must plan the same row: a different row on rank 0 is refused everywhere
    if n > 1:
        other = treecp.Row.from_segments([-1, 0], [30, 30]) if rank == 0 else row
        with pytest.raises(ValueError, match="planned another row"):
            tt.plan(other, group=group)


def _worker(rank, world, port, failures):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        # Groups of 1-4 ranks inside one set of processes (each process start costs seconds of imports).
        for n in range(1, world + 1):
            group = dist.new_group(list(range(n)))
            if rank < n:
                _check_group(rank, n, group)
            dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which fails the test
        import traceback
        failures.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise


def test_cp_over_gloo_on_1_to_4_ranks_equals_cp1():
    world = 4
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, failures)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, "\n".join(f"rank {r}: {m}" for r, m in sorted(errors))
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
