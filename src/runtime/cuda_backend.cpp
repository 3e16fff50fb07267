#include "runtime/cuda_backend.hpp"

#include <cstring>

#include "core/error.hpp"
#include "kernels/cpu/conv1d.hpp"

namespace treecp {

namespace {

// Rows [row, row + rows) of a buffer `width` elements wide (CpuBackend's check, on the device buffers' sizes).
void check_rows(int64_t size, int64_t row, int64_t rows, int64_t width, const char* what) {
  require(row >= 0 && rows >= 0 && (rows == 0 || (row + rows) * width <= size), what, ": rows [", row, ", ",
          row + rows, ") of width ", width, " outside a buffer of ", size, " elements");
}

void check_dims(const AttentionShape& d, const char* who) {
  require(cuda::attention_dims_supported(d.d, d.dv), who, ": the CUDA kernels take (D, Dv) ", cuda::attention_dims_list(),
          ", got D ", d.d, " Dv ", d.dv);
  require(d.hq >= 1 && d.hkv >= 1 && d.hq % d.hkv == 0, who, ": hq must be a positive multiple of hkv, got ", d.hq,
          " and ", d.hkv);
}

// What the forward and backward parameter blocks share: Q, K, V and the layouts of Q, K, V, O (and dO) and LSE.
template <class P>
void set_common(P& p, const AttentionShape& dims, const DeviceBuffer<cuda::bf16_t>& q, const KvView<cuda::bf16_t>& kv) {
  p.q = q.data();
  p.k = kv.k;
  p.v = kv.v;
  p.q_row_stride = int64_t{dims.hq} * dims.d;  // Q [rows, Hq, D]
  p.q_head_stride = dims.d;
  p.k_row_stride = kv.k_row_stride;
  p.k_head_stride = dims.d;
  p.v_row_stride = kv.v_row_stride;
  p.v_head_stride = dims.dv;
  p.o_row_stride = int64_t{dims.hq} * dims.dv;  // O (and dO) [rows, Hq, Dv]
  p.o_head_stride = dims.dv;
  p.lse_row_stride = dims.hq;  // LSE [rows, Hq]
  p.lse_head_stride = 1;
  p.hq = dims.hq;
  p.hkv = dims.hkv;
  p.head_dim = dims.d;
  p.value_dim = static_cast<int16_t>(dims.dv);
  p.scale = static_cast<float>(dims.softmax_scale());
}

}  // namespace

cuda::bf16_t to_bf16(float f) { return cuda::f32_to_bits(f, cuda::DType::kBf16); }
float from_bf16(cuda::bf16_t h) { return cuda::bits_to_f32(h, cuda::DType::kBf16); }

CudaBackend::CudaBackend(cudaStream_t stream, cuda::DType dtype)
    : pool_(std::make_unique<cuda::DevicePool>()),
      spare_plans_(std::make_shared<std::vector<std::unique_ptr<cuda::DeviceTilePlan>>>()) {
  set_dtype(dtype);
  if (stream == nullptr) {
    cuda::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "CudaBackend: stream");
    own_stream_ = true;
  } else {
    stream_ = stream;
  }
  fwd_workspace_bytes_ = cuda::attention_forward_workspace_bytes();
  fwd_workspace_ = pool_->allocate(fwd_workspace_bytes_);
}

CudaBackend::~CudaBackend() {
  if (stream_) cudaStreamSynchronize(stream_);  // nothing enqueued may outlive the pool it reads
  spare_plans_->clear();
  if (fwd_workspace_) pool_->deallocate(fwd_workspace_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (own_stream_) cudaStreamDestroy(stream_);
}

void CudaBackend::set_stream(cudaStream_t stream) {
  require(stream != nullptr, "CudaBackend::set_stream: the legacy default stream is not supported; pass a stream");
  if (own_stream_) {
    cuda::check_cuda(cudaStreamSynchronize(stream_), "CudaBackend::set_stream: synchronize");
    cudaStreamDestroy(stream_);
    own_stream_ = false;
  }
  stream_ = stream;
}

void CudaBackend::set_dtype(cuda::DType dtype) {
  require(dtype == cuda::DType::kBf16 || dtype == cuda::DType::kF16, "CudaBackend: dtype must be bf16 or fp16, got ",
          static_cast<int>(dtype));
  dtype_ = dtype;
}

void CudaBackend::set_gdn_precision(cuda::GdnPrecision precision) {
  require(cuda::gdn_precision_known(precision), "CudaBackend::set_gdn_precision: unknown precision ",
          static_cast<int>(precision));
  gdn_precision_ = precision;
}

void CudaBackend::synchronize() { cuda::check_cuda(cudaStreamSynchronize(stream_), "CudaBackend: synchronize"); }

void CudaBackend::zero(Grad& b) {
  if (b.size() > 0)
    cuda::check_cuda(cudaMemsetAsync(b.data(), 0, static_cast<size_t>(b.size()) * sizeof(float), stream_),
                     "CudaBackend: zero");
}

template <class T>
void CudaBackend::upload(DeviceBuffer<T>& b, const std::vector<T>& host) {
  require(static_cast<int64_t>(host.size()) == b.size(), "CudaBackend::upload: ", host.size(),
          " host elements for a buffer of ", b.size());
  if (host.empty()) return;
  cuda::check_cuda(cudaMemcpyAsync(b.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream_),
                   "CudaBackend: upload");
  synchronize();
}

template <class T>
std::vector<T> CudaBackend::download(const DeviceBuffer<T>& b) {
  std::vector<T> host(static_cast<size_t>(b.size()));
  if (host.empty()) return host;
  cuda::check_cuda(cudaMemcpyAsync(host.data(), b.data(), host.size() * sizeof(T), cudaMemcpyDeviceToHost, stream_),
                   "CudaBackend: download");
  synchronize();
  return host;
}

template void CudaBackend::upload(DeviceBuffer<cuda::bf16_t>&, const std::vector<cuda::bf16_t>&);
template void CudaBackend::upload(DeviceBuffer<float>&, const std::vector<float>&);
template std::vector<cuda::bf16_t> CudaBackend::download(const DeviceBuffer<cuda::bf16_t>&);
template std::vector<float> CudaBackend::download(const DeviceBuffer<float>&);

CudaBackend::HostGeometry CudaBackend::prepare_geometry(const std::vector<Slice>& slices, int64_t q_rows,
                                                        int64_t kv_rows, const AttentionShape& dims) {
  check_dims(dims, "CudaBackend");
  return std::make_shared<const cuda::TilePlan>(cuda::build_tile_plan(slices, q_rows, kv_rows, dims.hq / dims.hkv));
}

CudaBackend::Geometry CudaBackend::upload(const HostGeometry& g) {
  require(g != nullptr, "CudaBackend::upload: empty geometry");
  std::unique_ptr<cuda::DeviceTilePlan> plan;
  if (!spare_plans_->empty()) {
    plan = std::move(spare_plans_->back());
    spare_plans_->pop_back();
  } else {
    plan = std::make_unique<cuda::DeviceTilePlan>();
  }
  plan->upload(*g, stream_);
  auto spares = spare_plans_;
  return Geometry(plan.release(), [spares](cuda::DeviceTilePlan* p) {
    spares->push_back(std::unique_ptr<cuda::DeviceTilePlan>(p));
  });
}

CudaBackend::CopyList CudaBackend::upload(const std::vector<RowCopy>& copies) {
  std::vector<cuda::RowSpan> spans;
  spans.reserve(copies.size());
  for (const RowCopy& c : copies) spans.push_back({c.src_row, c.dst_row, c.rows});
  auto* list = new cuda::DeviceRowList(cuda::upload_row_list(*pool_, spans.data(), spans.size(), stream_));
  cuda::DevicePool* pool = pool_.get();
  return CopyList{std::shared_ptr<cuda::DeviceRowList>(list, [pool](cuda::DeviceRowList* l) {
    pool->deallocate(l->pairs);
    delete l;
  })};
}

template <class T>
void CudaBackend::copy_rows(const DeviceBuffer<T>& src, const std::vector<RowCopy>& copies, int64_t width,
                            DeviceBuffer<T>& dst) {
  for (const RowCopy& c : copies) {
    require(c.rows >= 0 && (c.src_row + c.rows) * width <= src.size() && (c.dst_row + c.rows) * width <= dst.size(),
            "CudaBackend::copy_rows: rows outside the buffers");
    if (c.rows == 0) continue;
    cuda::check_cuda(cudaMemcpyAsync(dst.data() + c.dst_row * width, src.data() + c.src_row * width,
                                     static_cast<size_t>(c.rows * width) * sizeof(T), cudaMemcpyDeviceToDevice, stream_),
                     "CudaBackend::copy_rows");
  }
}
template void CudaBackend::copy_rows(const DeviceBuffer<cuda::bf16_t>&, const std::vector<RowCopy>&, int64_t,
                                     DeviceBuffer<cuda::bf16_t>&);
template void CudaBackend::copy_rows(const DeviceBuffer<float>&, const std::vector<RowCopy>&, int64_t,
                                     DeviceBuffer<float>&);

void CudaBackend::pack_rows(const Act& src, int64_t src_width, const CopyList& copies, Act& dst, int64_t dst_width,
                            int64_t dst_col) {
  cuda::pack_rows_b16(src.data(), src_width, *copies.list, dst.data(), dst_width, dst_col, stream_);
}

void CudaBackend::add_rows(const Grad& src, int64_t src_width, int64_t src_col, int64_t cols, const CopyList& copies,
                           Grad& dst) {
  cuda::add_rows_f32(src.data(), src_width, src_col, cols, *copies.list, dst.data(), stream_);
}

void CudaBackend::attention_forward(const AttentionShape& dims, const Geometry& g, const Act& q, const KvView<Elem>& kv,
                                    Act& o, Stat& lse) {
  check_dims(dims, "attention_forward");
  cuda::AttentionForwardParams p;
  p.dtype = dtype_;
  set_common(p, dims, q, kv);
  p.o = o.data();
  p.lse = lse.data();
  p.workspace = fwd_workspace_;
  p.workspace_bytes = fwd_workspace_bytes_;
  cuda::attention_forward(p, *g, stream_);
}

void CudaBackend::merge_sink_forward(const AttentionShape& dims, int64_t rows, const std::vector<const Act*>& o_parts,
                                     const std::vector<const Stat*>& lse_parts, const Stat* sink, Act& y, Act* o_merged,
                                     Stat& lse) {
  require(!o_parts.empty() && o_parts.size() == lse_parts.size(), "merge_sink_forward: ", o_parts.size(),
          " output parts and ", lse_parts.size(), " LSE parts");
  // More parts than one launch takes: merge the first ones into a partial, which becomes part 0 of the rest.
  Act acc_o;
  Stat acc_lse;
  size_t next = 0;
  const int64_t o_elems = rows * dims.hq * dims.dv, l_elems = rows * dims.hq;
  while (o_parts.size() - next > static_cast<size_t>(cuda::kMaxMergeParts)) {
    cuda::MergeSinkForwardParams p;
    p.dtype = dtype_;
    p.num_parts = 0;
    if (acc_o.data()) {
      p.o_parts[p.num_parts] = acc_o.data();
      p.lse_parts[p.num_parts++] = acc_lse.data();
    }
    while (p.num_parts < cuda::kMaxMergeParts) {
      p.o_parts[p.num_parts] = o_parts[next]->data();
      p.lse_parts[p.num_parts++] = lse_parts[next++]->data();
    }
    Act out_o = alloc_act(o_elems);
    Stat out_l = alloc_stat(l_elems);
    p.y = out_o.data();
    p.lse = out_l.data();
    p.rows = rows;
    p.heads = dims.hq;
    p.head_dim = dims.dv;
    cuda::merge_sink_forward(p, stream_);
    acc_o = std::move(out_o);
    acc_lse = std::move(out_l);
  }
  cuda::MergeSinkForwardParams p;
  p.dtype = dtype_;
  if (acc_o.data()) {
    p.o_parts[p.num_parts] = acc_o.data();
    p.lse_parts[p.num_parts++] = acc_lse.data();
  }
  for (; next < o_parts.size(); ++next) {
    p.o_parts[p.num_parts] = o_parts[next]->data();
    p.lse_parts[p.num_parts++] = lse_parts[next]->data();
  }
  p.sink = sink ? sink->data() : nullptr;
  p.y = y.data();
  p.o_merged = sink && o_merged ? o_merged->data() : nullptr;
  p.lse = lse.data();
  p.rows = rows;
  p.heads = dims.hq;
  p.head_dim = dims.dv;
  cuda::merge_sink_forward(p, stream_);
}

const CudaBackend::Act& CudaBackend::merge_sink_backward(const AttentionShape& dims, int64_t rows, const Act& o,
                                                         const Stat& lse, const Stat* sink, const Act& dy, Act& d_o,
                                                         Stat& dsum, Stat* dsink) {
  // One part, the complete output: d_o = w dy and Dsum = w dot(dy, o) - dJ/dL. Without a sink w = 1 where a
  // row has keys, so dO is dy itself (rows without keys read no dO) and only Dsum is written.
  cuda::MergeSinkBackwardParams p;
  p.dtype = dtype_;
  p.num_parts = 1;
  p.o_parts[0] = o.data();
  p.lse_parts[0] = lse.data();
  p.sink = sink ? sink->data() : nullptr;
  p.g = dy.data();
  p.d_o = sink ? d_o.data() : nullptr;
  p.dsum = dsum.data();
  p.d_sink = dsink ? dsink->data() : nullptr;
  Stat scratch;
  if (sink && !dsink) {
    scratch = alloc_stat(dims.hq);
    p.d_sink = scratch.data();
  }
  p.rows = rows;
  p.heads = dims.hq;
  p.head_dim = dims.dv;
  cuda::merge_sink_backward(p, stream_);
  return sink ? d_o : dy;
}

void CudaBackend::attention_backward(const AttentionShape& dims, const Geometry& g, const Act& q, const KvView<Elem>& kv,
                                     const Act& o, const Stat& lse, const Act& d_o, const Stat& dsum, Grad& dq,
                                     const DkvView<GradElem>& dkv) {
  check_dims(dims, "attention_backward");
  // At Dv = D the kernels address dV with dK's strides; at Dv != D dV has strides of its own (int32 in the params).
  require(dims.dv != dims.d || dkv.dk_row_stride == dkv.dv_row_stride,
          "attention_backward: dK and dV must share a row stride at Dv = D, got ", dkv.dk_row_stride, " and ",
          dkv.dv_row_stride);
  require(dkv.dv_row_stride <= INT32_MAX, "attention_backward: dV's row stride must fit int32, got ", dkv.dv_row_stride);
  cuda::AttentionBackwardParams p;
  p.dtype = dtype_;
  set_common(p, dims, q, kv);
  p.o = o.data();
  p.d_o = d_o.data();
  p.lse = lse.data();
  p.dsum = const_cast<float*>(dsum.data());
  p.dsum_ready = true;
  p.dq = dq.data();
  p.dk = dkv.dk;
  p.dv = dkv.dv;
  p.dq_row_stride = int64_t{dims.hq} * dims.d;
  p.dq_head_stride = dims.d;
  p.dk_row_stride = dkv.dk_row_stride;
  p.dk_head_stride = dims.d;
  if (dims.dv != dims.d) {
    p.dv_row_stride = static_cast<int32_t>(dkv.dv_row_stride);
    p.dv_head_stride = dims.dv;
  }
  cuda::attention_backward(p, *g, stream_);
}

// ---- affine-state recurrences

void CudaBackend::affine_identity(const AffineShape& sh, Grad& maps, int64_t item) {
  check_rows(maps.size(), item, 1, sh.map_elements(), "affine identity maps");
  cuda::affine_identity(sh, maps.data() + item * sh.map_elements(), stream_);
}

void CudaBackend::affine_compose(const AffineShape& sh, int64_t items, Grad& later, const Grad& earlier) {
  check_rows(later.size(), 0, items, sh.map_elements(), "affine compose later");
  check_rows(earlier.size(), 0, items, sh.map_elements(), "affine compose earlier");
  Grad ws = alloc_grad(cuda::affine_workspace_floats(sh, items));
  cuda::affine_compose(sh, items, later.data(), earlier.data(), ws.data(), stream_);
}

void CudaBackend::affine_seed(const AffineShape& sh, Grad& maps, int64_t item, const Grad* state) {
  check_rows(maps.size(), item, 1, sh.map_elements(), "affine seed maps");
  if (state) check_rows(state->size(), 0, 1, sh.state_elements(), "affine seed state");
  Grad ws = alloc_grad(cuda::affine_workspace_floats(sh, 1));
  cuda::affine_seed(sh, maps.data() + item * sh.map_elements(), state ? state->data() : nullptr, ws.data(), stream_);
}

void CudaBackend::affine_adjoint(const AffineShape& sh, const Grad& map, const Grad& a, const Grad* g, Grad& maps,
                                 int64_t item) {
  check_rows(map.size(), 0, 1, sh.map_elements(), "affine adjoint map");
  check_rows(a.size(), 0, 1, sh.state_elements(), "affine adjoint a");
  check_rows(maps.size(), item, 1, sh.map_elements(), "affine adjoint maps");
  if (g) check_rows(g->size(), 0, 1, sh.state_elements(), "affine adjoint g");
  Grad ws = alloc_grad(cuda::affine_workspace_floats(sh, 1));
  cuda::affine_adjoint(sh, map.data(), a.data(), g ? g->data() : nullptr, maps.data() + item * sh.map_elements(),
                       ws.data(), stream_);
}

void CudaBackend::affine_state(const AffineShape& sh, const Grad& maps, int64_t item, Grad& state) {
  check_rows(maps.size(), item, 1, sh.map_elements(), "affine state maps");
  check_rows(state.size(), 0, 1, sh.state_elements(), "affine state");
  cuda::affine_state(sh, maps.data() + item * sh.map_elements(), state.data(), stream_);
}

// ---- GDN / KDA: one run of rows [row, row + rows) per call, its state in slot 0 (read and written in place:
// each scan block reads its tile of the state before its chunks and writes the same tile after them)

cuda::GdnCudaParams CudaBackend::gdn_params(const GdnShape& sh, const GdnInputs<Act>& in) const {
  sh.validate();
  cuda::GdnCudaParams p;
  p.tokens = gdn_input_tokens(sh, in, [](const Act& b) { return b.size(); });
  p.beta = in.beta->data();
  p.q = in.q->data();
  p.k = in.k->data();
  p.v = in.v->data();
  p.g = in.g->data();
  p.heads = sh.heads;
  p.dk = sh.dk;
  p.dv = sh.dv;
  p.gate = sh.gate;
  p.scale = static_cast<float>(sh.scale);
  p.dtype = dtype_;
  p.precision = gdn_precision_;  // fp32 unless set_gdn_precision chose a bf16 path (refused for fp16 by gdn_check)
  return p;
}

void CudaBackend::gdn_forward(const GdnShape& sh, const GdnInputs<Act>& in, int64_t row, int64_t rows, Grad& state,
                              Act& y) {
  cuda::GdnCudaParams p = gdn_params(sh, in);
  check_rows(state.size(), 0, 1, sh.affine().state_elements(), "gdn state");
  check_rows(y.size(), row, rows, sh.v_width(), "gdn y");
  const std::vector<cuda::GdnCudaRun> runs = {{row, row + rows, 0, 0}};
  p.y = gdn_forward_y_ ? y.data() : nullptr;  // set_gdn_forward_y(false): the states only
  p.state_in = state.data();
  p.state_out = state.data();
  p.fla_split = gdn_fla_split_ && cuda::gdn_fla_split_takes(p);  // elsewhere the classic forward (set_gdn_fla_split)
  p.keep_forward = p.fla_split && gdn_keep_forward_;
  p.workspace_bytes = cuda::gdn_workspace_bytes(p, runs, cuda::GdnCallKind::forward);  // the split's own, if it runs
  Grad scratch;  // the call's own workspace, unless the forward keeps it (set_gdn_keep_forward)
  if (p.keep_forward) {
    KeptGdn* kept = gdn_kept(p, row, rows);
    if (!kept) {
      gdn_kept_.push_back({p.q, p.k, p.v, p.g, p.beta, row, rows, Grad(), 0, 0});
      kept = &gdn_kept_.back();
    }
    kept->owner = gdn_keep_owner_;
    if (kept->bytes != p.workspace_bytes) {
      kept->workspace = workspace(static_cast<int64_t>(p.workspace_bytes));
      kept->bytes = p.workspace_bytes;
    }
    p.workspace = kept->workspace.data();
  } else {
    scratch = workspace(static_cast<int64_t>(p.workspace_bytes));
    p.workspace = scratch.data();
  }
  cuda::gdn_forward(p, runs, stream_);
}

void CudaBackend::release_gdn_kept(uint64_t owner) {  // stream order makes giving the workspaces back safe at once
  std::erase_if(gdn_kept_, [owner](const KeptGdn& e) { return e.owner == owner; });
}

int64_t CudaBackend::gdn_kept_bytes() const {
  int64_t n = 0;
  for (const KeptGdn& e : gdn_kept_) n += static_cast<int64_t>(e.bytes);
  return n;
}

CudaBackend::KeptGdn* CudaBackend::gdn_kept(const cuda::GdnCudaParams& p, int64_t row, int64_t rows) {
  for (KeptGdn& e : gdn_kept_)
    if (e.q == p.q && e.k == p.k && e.v == p.v && e.g == p.g && e.beta == p.beta && e.row == row && e.rows == rows)
      return &e;
  return nullptr;
}

void CudaBackend::gdn_backward(const GdnShape& sh, const GdnInputs<Act>& in, int64_t row, int64_t rows,
                               const Grad& state_in, const Act& dy, Grad& dstate, const GdnGradients<Grad>& grads) {
  cuda::GdnCudaParams p = gdn_params(sh, in);
  const int64_t state = sh.affine().state_elements();
  check_rows(state_in.size(), 0, 1, state, "gdn state_in");
  check_rows(dstate.size(), 0, 1, state, "gdn dstate");
  check_rows(dy.size(), row, rows, sh.v_width(), "gdn dy");
  auto ptr = [&](Grad* b, int64_t width, const char* what) -> float* {
    if (!b) return nullptr;
    check_rows(b->size(), row, rows, width, what);
    return b->data();
  };
  cuda::GdnCudaGrads g;
  g.dq = ptr(grads.dq, sh.qk_width(), "gdn dq");
  g.dk = ptr(grads.dk, sh.qk_width(), "gdn dk");
  g.dv = ptr(grads.dv, sh.v_width(), "gdn dv");
  g.dg = ptr(grads.dg, sh.g_width(), "gdn dg");
  g.dbeta = ptr(grads.dbeta, sh.heads, "gdn dbeta");
  g.dy = dy.data();
  g.d_state_out = dstate.data();  // read by each backward-scan block before it writes the same tile of d_state_in
  g.d_state_in = dstate.data();
  const std::vector<cuda::GdnCudaRun> runs = {{row, row + rows, 0, 0}};
  p.state_in = state_in.data();
  p.fla_split = gdn_fla_split_ && cuda::gdn_fla_split_takes(p);  // the split backward where the forward splits
  p.workspace_bytes = cuda::gdn_workspace_bytes(p, runs, cuda::GdnCallKind::backward);
  // A kept forward of these inputs and rows (set_gdn_keep_forward) hands its arrays over: no prep or scan again.
  KeptGdn* kept = p.fla_split ? gdn_kept(p, row, rows) : nullptr;
  p.keep_forward = kept && kept->bytes == p.workspace_bytes;
  Grad scratch;
  if (!p.keep_forward) scratch = workspace(static_cast<int64_t>(p.workspace_bytes));
  p.workspace = p.keep_forward ? kept->workspace.data() : scratch.data();
  cuda::gdn_backward(p, runs, g, stream_);
}

void CudaBackend::gdn_summary(const GdnShape& sh, const GdnInputs<Act>& in, int64_t row, int64_t rows, Grad& maps,
                              int64_t item) {
  cuda::GdnCudaParams p = gdn_params(sh, in);
  const AffineShape af = sh.affine();
  check_rows(maps.size(), item, 1, af.map_elements(), "gdn maps");
  const std::vector<cuda::GdnCudaRun> runs = {{row, row + rows, -1, 0}};
  p.workspace_bytes = cuda::gdn_workspace_bytes(p, runs, cuda::GdnCallKind::summary);
  Grad ws = workspace(static_cast<int64_t>(p.workspace_bytes));
  p.workspace = ws.data();
  Grad me = alloc_grad(af.map_elements());  // M [H][dk][dk] then E [H][dk][dv], contiguous
  float* M = me.data();
  float* E = M + int64_t{af.heads} * af.rows * af.rows;
  cuda::gdn_summary(p, runs, M, E, stream_);
  cuda::affine_interleave(af, M, E, maps.data() + item * af.map_elements(), stream_);
}

void CudaBackend::l2norm_forward(const Act& x, int64_t groups, int dim, Act& y) {
  check_rows(x.size(), 0, groups, dim, "l2norm x");
  check_rows(y.size(), 0, groups, dim, "l2norm y");
  cuda::l2norm_forward(x.data(), groups, dim, y.data(), dtype_, stream_);
}

void CudaBackend::l2norm_backward(const Act& x, const Grad& dy, int64_t groups, int dim, Grad& dx) {
  check_rows(x.size(), 0, groups, dim, "l2norm x");
  check_rows(dy.size(), 0, groups, dim, "l2norm dy");
  check_rows(dx.size(), 0, groups, dim, "l2norm dx");
  cuda::l2norm_backward(x.data(), dy.data(), groups, dim, dx.data(), dtype_, stream_);
}

// ---- short convolution

cuda::Conv1dDeviceParams CudaBackend::conv_params(const ConvShape& sh, const Act& x, const std::vector<int64_t>& prev,
                                                  int64_t out_rows, const Act& weight, const Act* bias,
                                                  DeviceBuffer<int64_t>& prev_dev) {
  const int64_t rows = static_cast<int64_t>(prev.size());
  check_rows(x.size(), 0, rows, sh.channels, "conv1d x");
  check_rows(weight.size(), 0, 1, int64_t{sh.channels} * sh.width, "conv1d weight");
  if (bias) check_rows(bias->size(), 0, 1, sh.channels, "conv1d bias");
  // kernels/cpu's checks (shape, rows, prev's range) on the host; its x and weight are only tested for null here.
  Conv1dParams<float> host;
  host.shape = sh;
  host.rows = rows;
  host.out_rows = out_rows;
  host.x = reinterpret_cast<const float*>(x.data());
  host.weight = reinterpret_cast<const float*>(weight.data());
  host.prev = prev.data();
  conv1d_check_params(host);
  prev_dev = DeviceBuffer<int64_t>(pool_.get(), rows);
  if (rows > 0)
    cuda::check_cuda(cudaMemcpyAsync(prev_dev.data(), prev.data(), static_cast<size_t>(rows) * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, stream_),
                     "conv1d: prev upload");
  cuda::Conv1dDeviceParams p;
  p.x = x.data();
  p.prev = prev_dev.data();
  p.weight = weight.data();
  p.bias = bias ? bias->data() : nullptr;
  p.out_rows = out_rows;
  p.shape = sh;
  p.dtype = dtype_;
  return p;
}

void CudaBackend::conv1d_forward(const ConvShape& sh, const Act& x, const std::vector<int64_t>& prev, int64_t out_rows,
                                 const Act& weight, const Act* bias, Act& y) {
  DeviceBuffer<int64_t> prev_dev;
  const cuda::Conv1dDeviceParams p = conv_params(sh, x, prev, out_rows, weight, bias, prev_dev);
  check_rows(y.size(), 0, out_rows, sh.channels, "conv1d y");
  cuda::conv1d_forward(p, y.data(), stream_);
}

void CudaBackend::conv1d_backward(const ConvShape& sh, const Act& x, const std::vector<int64_t>& prev,
                                  int64_t out_rows, const Act& weight, const Act* bias, const Grad& dy, Grad& dx,
                                  Grad& dweight, Grad* dbias) {
  DeviceBuffer<int64_t> prev_dev;
  const cuda::Conv1dDeviceParams p = conv_params(sh, x, prev, out_rows, weight, bias, prev_dev);
  check_rows(dy.size(), 0, out_rows, sh.channels, "conv1d dy");
  check_rows(dx.size(), 0, static_cast<int64_t>(prev.size()), sh.channels, "conv1d dx");
  check_rows(dweight.size(), 0, 1, int64_t{sh.channels} * sh.width, "conv1d dweight");
  if (dbias) check_rows(dbias->size(), 0, 1, sh.channels, "conv1d dbias");
  cuda::conv1d_backward(p, dy.data(), dx.data(), dweight.data(), dbias ? dbias->data() : nullptr, stream_);
}

CudaBackend::Mark CudaBackend::make_mark() {
  cudaEvent_t e = nullptr;
  cuda::check_cuda(cudaEventCreate(&e), "CudaBackend: event");
  events_.push_back(e);
  return Mark{e};
}

void CudaBackend::record(Mark& m) { cuda::check_cuda(cudaEventRecord(m.event, stream_), "CudaBackend: record"); }

double CudaBackend::elapsed_ms(const Mark& a, const Mark& b) {
  cuda::check_cuda(cudaEventSynchronize(b.event), "CudaBackend: event wait");
  float ms = 0.f;
  cuda::check_cuda(cudaEventElapsedTime(&ms, a.event, b.event), "CudaBackend: elapsed");
  return ms;
}

}  // namespace treecp
