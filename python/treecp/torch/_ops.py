"""The ops, registered with torch.library: custom ops with fake (meta) implementations and autograd.

Every op checks its inputs by name and, under CP, agrees with the other ranks on the verdict (one
small all-gather) before any collective moves data: bad input on one rank raises ValueError on every
rank. The fake implementations only compute output shapes, so torch.compile traces the ops without
running them. Backward ops take tensors only (no C++ state between forward and backward): attention's
is the runtime's stateless backward (it fetches remote KV again); GDN's and the convolution's run their
forward protocol again first.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch import Tensor

from .. import _core
from ._checks import _check_tensor
from ._comm import nccl_communicator
from ._key import Key, default_scale, key_of

_CPU_DTYPES = (torch.float32, torch.float64)
# On CUDA every op's kernels take bf16 or fp16 (attention, GDN/KDA, the short convolution).
_CUDA_DTYPES = (torch.bfloat16, torch.float16)
# The (D, Dv) pairs of q/k's and v's head dims the CUDA attention kernels are instantiated for: the extension's copy
# of the kernels' table (kernels/cuda/attention_dims.hpp), there in builds without CUDA too.
_CUDA_ATTENTION_DIMS = tuple(tuple(p) for p in _core.cuda_attention_dims)


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _first(*problems) -> Optional[str]:
    for p in problems:
        if p:
            return p
    return None


def _check_compute(op: str, tensors: dict, shapes: dict) -> Optional[str]:
    """Device, dtype, shape and stride checks of a compute op's tensors (None entries are optional and absent).

    ``shapes[name]`` is the expected shape (ints, or None for "any"); the first tensor sets device and dtype, and
    every other tensor must have both.
    """
    tensors = {name: x for name, x in tensors.items() if x is not None}
    ref_name, ref = next(iter(tensors.items()))
    for name, x in tensors.items():
        p = _check_tensor(op, name, x)
        if p:
            return p
    if ref.device.type == "cuda":
        if not _core.has_cuda_backend:
            return (f"{op}: {ref_name} is on {ref.device}: this build of treecp has no CUDA backend (it was built "
                    "without nvcc); CPU tensors, float32 or float64")
        if ref.dtype not in _CUDA_DTYPES:
            return f"{op}: {ref_name} has dtype {ref.dtype}; on CUDA treecp takes bfloat16 or float16"
    elif ref.device.type != "cpu":
        return (f"{op}: {ref_name} is on {ref.device}; treecp runs on CPU (float32, float64) and CUDA (bfloat16, "
                "float16) tensors")
    elif ref.dtype not in _CPU_DTYPES:
        return f"{op}: {ref_name} has dtype {ref.dtype}; on CPU treecp takes float32 or float64"
    for name, x in tensors.items():
        if x.device != ref.device:
            return f"{op}: {name} is on {x.device} but {ref_name} is on {ref.device}"
        if x.dtype != ref.dtype:
            return f"{op}: {name} has dtype {x.dtype} but {ref_name} has {ref.dtype}"
        want = shapes[name]
        if x.dim() != len(want) or any(w is not None and s != w for s, w in zip(x.shape, want)):
            shown = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
            return f"{op}: {name} has shape {list(x.shape)}, expected {shown}"
        if not x.is_contiguous():
            return (f"{op}: {name} has strides {x.stride()} for shape {list(x.shape)}; the kernels take C-contiguous "
                    "tensors (call .contiguous())")
    return None


def _verdict(key: Key, op: str, problem: Optional[str], same: Optional[tuple[str, bool]] = None):
    """Raises ValueError on every rank of the key's group if any rank found a problem, or made the choice `same`
    (what, value) otherwise than another rank.

    Under torch.compile the checks run while tracing, on this rank's metadata, and the compiled graph is
    guarded on that metadata; eager calls agree with the other ranks first (one all-gather of flags).
    """
    if torch.compiler.is_compiling():
        if problem:
            raise ValueError(problem)
    else:
        key.agree(op, problem, same)


def _detached(*xs):
    """The tensors as the extension takes them (DLPack, nb::ndarray): detached, None passed through.

    torch's ``__dlpack__`` refuses tensors that require grad (autograd's saved inputs and dy inside a backward
    op, nn.Parameters); nanobind >= 3 then falls back to torch's legacy exporter, older nanobind raises
    TypeError, so every tensor crosses detached, forward and backward alike.
    """
    return tuple(None if x is None else x.detach() for x in xs)


def _refuse(problem: Optional[str]):
    # The ops' own implementations check again, locally, for direct calls of torch.ops.treecp.*.
    if problem:
        raise ValueError(problem)


def _cuda_key_problem(op: str, key: Key, name: str, x: Tensor) -> Optional[str]:
    """What the key itself refuses for CUDA tensors (x, named `name`, sets the device)."""
    if key.nccl_group is not None and not _core.has_nccl:
        return (f"{op}: CUDA tensors with a group need NCCL, and this build of treecp has none (it was built "
                "without nccl.h); CP runs on CPU tensors over gloo")
    if key.cuda_device is not None and x.device != key.cuda_device:
        return f"{op}: {name} is on {x.device} but this key's CUDA state is on {key.cuda_device} (one key per device)"
    return None


def _key_argument(op: str, key) -> Key:
    if not isinstance(key, Key):
        raise TypeError(f"{op}: key must be a treecp.torch.Key (from treecp.torch.plan), got {type(key).__name__}")
    return key


# ---------------------------------------------------------------- attention


def _cuda_attention_dims_problem(op: str, d: int, dv: int) -> Optional[str]:
    if (d, dv) in _CUDA_ATTENTION_DIMS:
        return None
    pairs = ", ".join(f"({a}, {b})" for a, b in _CUDA_ATTENTION_DIMS)
    return f"{op}: on CUDA the head dims (D of q and k, Dv of v) must be one of (D, Dv) {pairs}, got ({d}, {dv})"


def _attention_problem(key: Key, q, k, v, sink, scale) -> Optional[str]:
    op = "attention"
    n = key.local_tokens
    p = _first(_check_tensor(op, "q", q, n, "tokens this rank owns under the key"),
               _check_tensor(op, "k", k, n, "tokens this rank owns under the key"),
               _check_tensor(op, "v", v, n, "tokens this rank owns under the key"))
    if p:
        return p
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            return f"{op}: {name} must be token-major [tokens, heads, head_dim], got shape {list(x.shape)}"
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.shape[1], v.shape[2]
    if hkv == 0 or hq % hkv != 0:
        return f"{op}: k has {hkv} heads, which must divide q's {hq} heads (GQA)"
    p = _check_compute(op, {"q": q, "k": k, "v": v, "sink": sink},
                       {"q": (n, hq, d), "k": (n, hkv, d), "v": (n, hkv, None), "sink": (hq,)})
    if p:
        return p
    if q.device.type == "cuda":
        p = _first(_cuda_attention_dims_problem(op, d, dv), _cuda_key_problem(op, key, "q", q))
        if p:
            return p
    if scale is not None and not _positive_number(scale):  # None: the default, 1/sqrt(D)
        return f"{op}: softmax_scale must be a positive finite number, got {scale}"
    return None


@torch.library.custom_op("treecp::attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], key_id: str,
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, lse, o before the sink); the last is empty without a sink (y is that output then)."""
    key = key_of(key_id)
    _refuse(_attention_problem(key, q, k, v, sink, scale))
    if q.device.type == "cuda":
        return _cuda_attention_forward(key, q, k, v, sink, scale)
    y = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[0], q.shape[1])
    o_presink = torch.empty_like(y) if sink is not None else q.new_empty(0)
    key._core.attention_forward(q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, *_detached(q, k, v, sink), y,
                                lse, o_presink if sink is not None else None)
    return y, lse, o_presink


@_attention_op.register_fake
def _(q, k, v, sink, key_id, scale):
    y = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return y, q.new_empty(q.shape[0], q.shape[1], dtype=_stat_dtype(q)), \
        torch.empty_like(y) if sink is not None else q.new_empty(0)


def _stat_dtype(q):
    # LSE: float32 on CUDA (bf16 or fp16 activations, fp32 statistics), the activations' dtype on CPU
    return torch.float32 if q.device.type == "cuda" else q.dtype


class _KeyStream:
    """Runs the key's CUDA work on its backend's stream, ordered after and before the caller's current stream."""

    def __init__(self, key, device):
        self.device = device
        self.stream = torch.cuda.ExternalStream(key._core.cuda_stream(device.index), device=device)

    def __enter__(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return self

    def __exit__(self, *exc):
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return False


def _cuda_state(key, device):
    """Binds the key to its CUDA device and, with a group, to the group's NCCL communicator (made on first use)."""
    if key.cuda_device is None:
        key.cuda_device = device
    if key.nccl_group is not None and key.nccl is None:
        key.nccl = nccl_communicator(key.nccl_group, device)
        key._core.use_nccl(key.nccl)


def _cuda_attention_forward(key, q, k, v, sink, scale):
    _cuda_state(key, q.device)
    y = q.new_empty(q.shape[0], q.shape[1], v.shape[2])  # [n, Hq, Dv]
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)
    o_presink = torch.empty_like(y) if sink is not None else q.new_empty(0)
    sink32 = sink.detach().float().contiguous() if sink is not None else None
    with _KeyStream(key, q.device):
        key._core.cuda_attention_forward(q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, q.device.index,
                                         q.dtype == torch.float16, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                         sink32.data_ptr() if sink32 is not None else 0, y.data_ptr(), lse.data_ptr(),
                                         o_presink.data_ptr() if sink is not None else 0)
        if sink32 is not None:
            sink32.record_stream(torch.cuda.current_stream(q.device))
    return y, lse, o_presink


def _cuda_attention_backward(key, q, k, v, sink, o, lse, dy, scale):
    _cuda_state(key, q.device)
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
    dsink = torch.zeros(q.shape[1] if sink is not None else 0, dtype=torch.float32, device=q.device)
    sink32 = sink.float().contiguous() if sink is not None else None
    with _KeyStream(key, q.device):
        key._core.cuda_attention_backward(q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale, q.device.index,
                                          q.dtype == torch.float16, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                          sink32.data_ptr() if sink32 is not None else 0, o.data_ptr(), lse.data_ptr(),
                                          dy.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                          dsink.data_ptr() if sink is not None else 0)
    # (without a sink dsink is empty, in q's dtype like the fake implementation's)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink.to(sink.dtype if sink is not None else q.dtype)


@torch.library.custom_op("treecp::attention_backward", mutates_args=())
def _attention_backward_op(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], o: Tensor, lse: Tensor,
                           dy: Tensor, key_id: str, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The runtime's stateless backward: o is the output before the sink, lse the forward's."""
    key = key_of(key_id)
    if q.device.type == "cuda":
        return _cuda_attention_backward(key, q, k, v, sink, o, lse, dy.to(q.dtype).contiguous(), scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = q.new_zeros(q.shape[1] if sink is not None else 0)
    key._core.attention_backward(q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale,
                                 *_detached(q, k, v, sink, o, lse, dy.contiguous()), dq, dk, dv,
                                 dsink if sink is not None else None)
    return dq, dk, dv, dsink


@_attention_backward_op.register_fake
def _(q, k, v, sink, o, lse, dy, key_id, scale):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(q.shape[1] if sink is not None else 0))


def _attention_setup(ctx, inputs, output):
    q, k, v, sink, key_id, scale = inputs
    y, lse, o_presink = output
    ctx.save_for_backward(q, k, v, sink, o_presink if sink is not None else y, lse)
    ctx.key_id, ctx.scale, ctx.has_sink = key_id, scale, sink is not None
    ctx.key = key_of(key_id)  # keys are held by id: the graph keeps this one alive until backward
    ctx.mark_non_differentiable(lse, o_presink)


def _attention_grad(ctx, dy, _dlse, _do_presink):
    q, k, v, sink, o, lse = ctx.saved_tensors
    dq, dk, dv, dsink = _attention_backward_op(q, k, v, sink, o, lse, dy, ctx.key_id, ctx.scale)
    return dq, dk, dv, dsink if ctx.has_sink else None, None, None


torch.library.register_autograd("treecp::attention", _attention_grad, setup_context=_attention_setup)


def attention(q: Tensor, k: Tensor, v: Tensor, key: Key, sink: Optional[Tensor] = None,
              softmax_scale: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """Tree attention on this rank's tokens: ``q [n, Hq, D]``, ``k [n, Hkv, D]``, ``v [n, Hkv, Dv]``.

    Returns ``o [n, Hq, Dv]`` (the learned sink ``[Hq]``, if given, applied once) and ``lse [n, Hq]``, the
    natural log of the softmax denominator over the visible tokens (before the sink; no gradient flows
    through it). ``softmax_scale`` defaults to 1/sqrt(D). The sink's gradient is this rank's contribution.
    q, k, v and sink share one dtype: float32 or float64 on CPU (any head dims), bfloat16 or float16 on CUDA, where
    (D, Dv) must be one of ``treecp.torch.CUDA_ATTENTION_DIMS``: (64, 64), (128, 128), (192, 128) (MLA's dense form)
    or (256, 256) (fp32 LSE, softmax and accumulation, gradients in the inputs' dtype).
    """
    key = _key_argument("attention", key)
    # The default scale is formed after the checks: under torch.compile a head dim that has changed between calls is
    # symbolic, and so is 1/sqrt(D), which the custom op takes as it is but math.isfinite cannot test.
    _verdict(key, "attention", _attention_problem(key, q, k, v, sink, softmax_scale))
    if softmax_scale is None:
        softmax_scale = default_scale(q.shape[-1])
    y, lse, _ = _attention_op(q, k, v, sink, key.id, float(softmax_scale))
    return y, lse


# ---------------------------------------------------------------- Gated DeltaNet / KDA


_CUDA_GDN_MAX_DIM = 256  # the CUDA scans' state tile (kernels/cuda/gdn_device.cuh, kGdnMaxDim)


# The CUDA chunk kernels' products (CudaBackend::set_gdn_precision): fp32, or bf16 tensor cores in prep and the
# gradients (bf16_tensor) and in the scans too (bf16_tensor_scans). Index = cuda::GdnPrecision.
_GDN_PRECISIONS = ("fp32", "bf16_tensor", "bf16_tensor_scans")


def _gdn_problem(key: Key, q, k, v, g, beta, scale, chunk, precision="fp32", fla_split=False,
                 keep_for_backward=False) -> Optional[str]:
    op = "gated_delta_rule"
    n = key.local_tokens
    what = "tokens this rank owns under the key"
    p = _first(*(_check_tensor(op, name, x, n, what) for name, x in (("q", q), ("k", k), ("v", v), ("g", g),
                                                                     ("beta", beta))))
    if p:
        return p
    if q.dim() != 3 or v.dim() != 3:
        bad, x = ("q", q) if q.dim() != 3 else ("v", v)
        return f"{op}: {bad} must be token-major [tokens, heads, head_dim], got shape {list(x.shape)}"
    h, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    g_shape = (n, h) if g.dim() == 2 else (n, h, dk)
    p = _check_compute(op, {"q": q, "k": k, "v": v, "g": g, "beta": beta},
                       {"q": (n, h, dk), "k": (n, h, dk), "v": (n, h, dv), "g": g_shape, "beta": (n, h)})
    if p:
        if g.dim() not in (2, 3) and "g has shape" in p:
            p += " (GDN: [tokens, H]; KDA: [tokens, H, K])"
        return p
    if q.device.type == "cuda":
        if dk > _CUDA_GDN_MAX_DIM or dv > _CUDA_GDN_MAX_DIM:
            return f"{op}: on CUDA the head dims must be at most {_CUDA_GDN_MAX_DIM}, got q's {dk} and v's {dv}"
        p = _cuda_key_problem(op, key, "q", q)
        if p:
            return p
    if scale is not None and not _positive_number(scale):  # None: the default, 1/sqrt(K)
        return f"{op}: scale must be a positive finite number, got {scale}"
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 4096:
        return f"{op}: chunk_size must be in [1, 4096], got {chunk}"
    if not isinstance(precision, str) or precision not in _GDN_PRECISIONS:
        return f"{op}: precision must be one of {', '.join(_GDN_PRECISIONS)}, got {precision!r}"
    if precision != "fp32":
        if q.device.type != "cuda":
            return (f"{op}: precision {precision!r} chooses the CUDA kernels' products; on CPU treecp computes in the "
                    f"inputs' dtype ({q.dtype}): pass precision='fp32'")
        if q.dtype != torch.bfloat16:
            return (f"{op}: precision {precision!r} needs bfloat16 inputs, got {q.dtype} (float16 runs the fp32 "
                    "products: the bf16 paths' intermediates could overflow float16)")
    if not isinstance(fla_split, bool):
        return f"{op}: fla_split must be a bool, got {type(fla_split).__name__}"
    if not isinstance(keep_for_backward, bool):
        return f"{op}: keep_for_backward must be a bool, got {type(keep_for_backward).__name__}"
    if fla_split and precision != "bf16_tensor_scans":
        # The split's arithmetic is bf16_tensor_scans': asking for it with another precision is a contradiction.
        return (f"{op}: fla_split runs every product on bf16 tensor cores: it needs precision='bf16_tensor_scans', "
                f"got {precision!r}")
    return None


def _ptrs(*xs):
    """Device addresses for the extension's CUDA calls; 0 for an absent optional tensor."""
    return tuple(0 if x is None else x.data_ptr() for x in xs)


def _fp32_like(*xs):
    """Gradient accumulators: fp32 on the inputs' device, whatever their dtype."""
    return [torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in xs]


def _cuda_gdn_forward(key, q, k, v, g, beta, scale, chunk, precision, fla_split, keep):
    # The CUDA kernels' chunk is their own (64): chunk_size steers only the plan's cost model here.
    _cuda_state(key, q.device)
    y = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    with _KeyStream(key, q.device):
        key._core.cuda_gdn_forward(q.shape[1], q.shape[2], v.shape[2], g.dim() == 3, scale, chunk,
                                   _GDN_PRECISIONS.index(precision), fla_split, q.device.index,
                                   q.dtype == torch.float16, *_ptrs(q, k, v, g, beta, y), keep)
    return y


def _cuda_gdn_backward(key, q, k, v, g, beta, dy, scale, chunk, precision, fla_split, keep):
    _cuda_state(key, q.device)
    dy = dy.to(q.dtype).contiguous()
    grads = _fp32_like(q, k, v, g, beta)
    with _KeyStream(key, q.device) as scope:
        dy.record_stream(scope.stream)
        key._core.cuda_gdn_backward(q.shape[1], q.shape[2], v.shape[2], g.dim() == 3, scale, chunk,
                                    _GDN_PRECISIONS.index(precision), fla_split, q.device.index,
                                    q.dtype == torch.float16, *_ptrs(q, k, v, g, beta, dy, *grads), keep)
    return tuple(d.to(x.dtype) for d, x in zip(grads, (q, k, v, g, beta)))


@torch.library.custom_op("treecp::gated_delta_rule", mutates_args=())
def _gdn_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, key_id: str, scale: float,
            chunk: int, precision: str, fla_split: bool, keep: bool) -> Tensor:
    key = key_of(key_id)
    _refuse(_gdn_problem(key, q, k, v, g, beta, scale, chunk, precision, fla_split, keep))
    if q.device.type == "cuda":
        return _cuda_gdn_forward(key, q, k, v, g, beta, scale, chunk, precision, fla_split, keep)
    y = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    key._core.gdn_forward(q.shape[1], q.shape[2], v.shape[2], g.dim() == 3, scale, chunk,
                          *_detached(q, k, v, g, beta), y, keep)
    return y


@_gdn_op.register_fake
def _(q, k, v, g, beta, key_id, scale, chunk, precision, fla_split, keep):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("treecp::gated_delta_rule_backward", mutates_args=())
def _gdn_backward_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, dy: Tensor, key_id: str, scale: float,
                     chunk: int, precision: str, fla_split: bool,
                     keep: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    key = key_of(key_id)
    if q.device.type == "cuda":
        return _cuda_gdn_backward(key, q, k, v, g, beta, dy, scale, chunk, precision, fla_split, keep)
    grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
    key._core.gdn_backward(q.shape[1], q.shape[2], v.shape[2], g.dim() == 3, scale, chunk,
                           *_detached(q, k, v, g, beta, dy.contiguous()), *grads, keep)
    return tuple(grads)


@_gdn_backward_op.register_fake
def _(q, k, v, g, beta, dy, key_id, scale, chunk, precision, fla_split, keep):
    return tuple(torch.empty_like(x) for x in (q, k, v, g, beta))


class _KeptRun:
    """Held by the autograd node of a forward that kept its run for the backward (keep_for_backward): when the node
    goes (after its backward, which takes the run, or unused), the run is dropped with it."""

    def __init__(self, core):
        weakref.finalize(self, core.drop_gdn_saved, core.last_gdn_saved())  # the run the forward just kept


def _gdn_setup(ctx, inputs, output):
    q, k, v, g, beta, key_id, scale, chunk, precision, fla_split, keep = inputs
    ctx.save_for_backward(q, k, v, g, beta)
    ctx.key_id, ctx.scale, ctx.chunk, ctx.precision, ctx.fla_split = key_id, scale, chunk, precision, fla_split
    ctx.key = key_of(key_id)  # keys are held by id: the graph keeps this one alive until backward
    ctx.keep = keep
    if keep:
        ctx.kept_run = _KeptRun(ctx.key._core)


def _gdn_grad(ctx, dy):
    q, k, v, g, beta = ctx.saved_tensors
    return (*_gdn_backward_op(q, k, v, g, beta, dy, ctx.key_id, ctx.scale, ctx.chunk, ctx.precision, ctx.fla_split,
                              ctx.keep),
            None, None, None, None, None, None)


torch.library.register_autograd("treecp::gated_delta_rule", _gdn_grad, setup_context=_gdn_setup)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, key: Key,
                     scale: Optional[float] = None, chunk_size: int = 64, precision: str = "fp32",
                     fla_split: bool = False, keep_for_backward: bool = False) -> Tensor:
    """Gated DeltaNet over the tree on this rank's tokens (FLA's conventions, token-major).

    ``q, k [n, H, K]``, ``v [n, H, V]``, ``g`` the log decay, ``[n, H]`` (GDN) or ``[n, H, K]`` (KDA), and
    ``beta [n, H]``. ``g`` must be at most 0 (the log of a decay in (0, 1], as FLA's ``logsigmoid`` gates give):
    values are not checked, since a check would synchronise with the device (``treecp gdn`` refuses them). Each token's state starts from its parent token's along the tree path (a child
    continues its parent segment's final state; siblings never see each other). ``scale`` defaults to
    1/sqrt(K), applied to q. Returns ``o [n, H, V]``. On CUDA (bfloat16 or float16, K and V at most 256) the states and
    gradients accumulate in fp32, and the kernels' own chunk (64) is used: ``chunk_size`` then steers the plan only.
    ``precision`` picks the CUDA kernels' products: ``"fp32"`` (the default), or bf16 tensor cores on bf16-rounded
    operands, ``"bf16_tensor"`` (prep and gradients: on an H200 about 20% faster forward+backward) or
    ``"bf16_tensor_scans"`` (the scans too); the bf16 paths take bfloat16 inputs on CUDA only. ``fla_split=True``
    (with ``precision="bf16_tensor_scans"``, whose arithmetic it is) asks for the forward split as FLA splits it
    (compact prep, the scan's state in registers, a chunk-parallel output; ``CudaBackend::set_gdn_fla_split``):
    where the call does not qualify (KDA's per-channel gate, K or V other than 64 or 128) the classic forward runs.
    The backward makes the same choice: the split backward (a reverse scan of the state gradient, chunk-parallel
    gradients) where the forward splits, the classic backward elsewhere. The backward runs the forward again for the
    states each run starts from; that forward keeps the split's arrays for the backward in the same call
    (``CudaBackend::set_gdn_keep_forward``), so the split's prep and scan run once there, not twice.
    ``keep_for_backward=True`` trades memory for time: a forward under autograd (grad enabled, an input requiring
    grad, not inside ``torch.compile``) keeps its run (the inputs in the plan's layout, the states each run started
    from, on CUDA the split's arrays: about 3.5 GB at 40,960 tokens, H 32, K = V = 128) until its backward, which then
    does not run the forward again; the run goes with the autograd graph if no backward comes. Every rank of the key
    must make the same choice (a rank that differs is refused on every rank, with the checks).
    """
    key = _key_argument("gated_delta_rule", key)
    # Kept only where a backward can come and a graph node holds the run's lifetime (torch.compile traces the
    # node's setup, so it runs the forward again instead); the ranks agree on it with the checks (a rank whose
    # backward runs the forward again would call collectives the others do not).
    keep = (keep_for_backward is True and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and any(isinstance(x, Tensor) and x.requires_grad for x in (q, k, v, g, beta)))
    _verdict(key, "gated_delta_rule", _gdn_problem(key, q, k, v, g, beta, scale, chunk_size, precision, fla_split,
                                                   keep_for_backward),
             ("keep_for_backward (with grad enabled and an input requiring grad)", keep))
    if scale is None:  # after the checks, as attention's softmax_scale
        scale = default_scale(q.shape[-1])
    return _gdn_op(q, k, v, g, beta, key.id, float(scale), int(chunk_size), precision, fla_split, keep)


# ---------------------------------------------------------------- short convolution

_ACTIVATIONS = (None, "silu")


def _conv_problem(key: Key, x, weight, bias) -> Optional[str]:
    op = "short_conv"
    n = key.local_tokens
    p = _first(_check_tensor(op, "x", x, n, "tokens this rank owns under the key"),
               _check_tensor(op, "weight", weight))
    if p:
        return p
    if x.dim() != 2 or weight.dim() != 2:
        bad, t, want = ("x", x, "[tokens, channels]") if x.dim() != 2 else ("weight", weight, "[channels, width]")
        return f"{op}: {bad} must be {want}, got shape {list(t.shape)}"
    c, w = x.shape[1], weight.shape[1]
    p = _check_compute(op, {"x": x, "weight": weight, "bias": bias}, {"x": (n, c), "weight": (c, w), "bias": (c,)})
    if p:
        return p
    if not 1 <= w <= 64:
        return f"{op}: weight's width (second dimension) must be in [1, 64], got {w}"
    if x.device.type == "cuda":
        return _cuda_key_problem(op, key, "x", x)
    return None


def _cuda_conv_forward(key, x, weight, bias, silu):
    _cuda_state(key, x.device)
    y = torch.empty_like(x)
    with _KeyStream(key, x.device):
        key._core.cuda_conv_forward(x.shape[1], weight.shape[1], silu, x.device.index, x.dtype == torch.float16,
                                    *_ptrs(x, weight, bias, y))
    return y


def _cuda_conv_backward(key, x, weight, bias, dy, silu):
    _cuda_state(key, x.device)
    dy = dy.float().contiguous()
    dx, dw, db = _fp32_like(x, weight, bias if bias is not None else x.new_empty(0))
    with _KeyStream(key, x.device) as scope:
        dy.record_stream(scope.stream)
        key._core.cuda_conv_backward(x.shape[1], weight.shape[1], silu, x.device.index, x.dtype == torch.float16,
                                     *_ptrs(x, weight, bias, dy, dx, dw, db if bias is not None else None))
    # The runtime hands every rank the weights' gradient summed over the ranks; the package's contract is this
    # rank's share, as on the CPU (KeyCore::conv_backward).
    share = 1.0 / key.cp
    return dx.to(x.dtype), (dw * share).to(weight.dtype), (db * share).to(x.dtype)


@torch.library.custom_op("treecp::short_conv", mutates_args=())
def _conv_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], key_id: str, silu: bool) -> Tensor:
    key = key_of(key_id)
    _refuse(_conv_problem(key, x, weight, bias))
    if x.device.type == "cuda":
        return _cuda_conv_forward(key, x, weight, bias, silu)
    y = torch.empty_like(x)
    key._core.conv_forward(x.shape[1], weight.shape[1], silu, *_detached(x, weight, bias), y)
    return y


@_conv_op.register_fake
def _(x, weight, bias, key_id, silu):
    return torch.empty_like(x)


@torch.library.custom_op("treecp::short_conv_backward", mutates_args=())
def _conv_backward_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], dy: Tensor, key_id: str,
                      silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    key = key_of(key_id)
    if x.device.type == "cuda":
        return _cuda_conv_backward(key, x, weight, bias, dy, silu)
    dx, dw = torch.empty_like(x), torch.empty_like(weight)
    db = x.new_zeros(x.shape[1] if bias is not None else 0)
    key._core.conv_backward(x.shape[1], weight.shape[1], silu, *_detached(x, weight, bias, dy.contiguous()), dx, dw,
                            db if bias is not None else None)
    return dx, dw, db


@_conv_backward_op.register_fake
def _(x, weight, bias, dy, key_id, silu):
    return torch.empty_like(x), torch.empty_like(weight), x.new_empty(x.shape[1] if bias is not None else 0)


def _conv_setup(ctx, inputs, output):
    x, weight, bias, key_id, silu = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.key_id, ctx.silu, ctx.has_bias = key_id, silu, bias is not None
    ctx.key = key_of(key_id)  # keys are held by id: the graph keeps this one alive until backward


def _conv_grad(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = _conv_backward_op(x, weight, bias, dy, ctx.key_id, ctx.silu)
    return dx, dw, db if ctx.has_bias else None, None, None


torch.library.register_autograd("treecp::short_conv", _conv_grad, setup_context=_conv_setup)


def short_conv(x: Tensor, weight: Tensor, key: Key, bias: Optional[Tensor] = None,
               activation: Optional[str] = None) -> Tensor:
    """Causal depthwise convolution along each token's tree path: ``x [n, C]``, ``weight [C, width]``.

    ``y_t = bias + sum_i weight[:, width-1-i] * x_{pred^i(t)}`` where pred is the logical predecessor (a
    child's first token continues its parent's last), then ``activation`` (None or "silu"). The gradients
    of ``weight`` and ``bias`` are this rank's contribution. On CUDA every tensor is bfloat16 or float16, one dtype (fp32 gradient
    accumulators inside).
    """
    key = _key_argument("short_conv", key)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"short_conv: activation must be None or 'silu', got {activation!r}")
    _verdict(key, "short_conv", _conv_problem(key, x, weight, bias))
    return _conv_op(x, weight, bias, key.id, activation == "silu")
