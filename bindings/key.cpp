#include "key.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/error.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/gdn_cp.hpp"
#include "runtime/redistribute.hpp"
#if TREECP_HAVE_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda_backend.hpp"
#endif
#if TREECP_HAVE_NCCL
#include "comm/nccl_communicator.hpp"
#endif

namespace treecp::py {
namespace {

template <class T>
std::vector<T> to_vector(const T* data, int64_t n) {
  return n > 0 ? std::vector<T>(data, data + n) : std::vector<T>();
}

template <class T>
void copy_out(const std::vector<T>& src, T* dst) {
  if (!src.empty()) std::memcpy(dst, src.data(), src.size() * sizeof(T));
}

// The layer's shape (kernels/shapes.hpp): the call's head dims and scale, the plan's window.
AttentionShape attention_shape(const AttentionCall& c, int64_t window) {
  return AttentionShape{c.hq, c.hkv, c.d, c.dv, window, c.scale};
}

GdnShape gdn_shape(const GdnCall& c) {
  return GdnShape{c.heads, c.dk, c.dv, c.per_channel_gate ? GdnGate::PerChannel : GdnGate::Scalar, c.scale, c.chunk};
}

// One call's inputs moved from the attention layout into the GDN plan's layout.
template <class Buf>
struct GdnArrays {
  Buf q, k, v, g, beta;
};

// view(x, width): the caller's array x of this rank's tokens, `width` elements each, as a backend buffer.
template <class Backend, class View, class Ptr>
GdnArrays<typename Backend::Act> gdn_arrays(Communicator& comm, Backend& be, const Ownership& from,
                                            const Ownership& to, const GdnShape& s, View view, Ptr q, Ptr k, Ptr v,
                                            Ptr g, Ptr beta) {
  // Where the plan's ownership is the key's, nothing moves: the view itself (no copy for a device view).
  auto move = [&](Ptr x, int64_t width) {
    return from == to ? view(x, width) : redistribute(comm, be, view(x, width), from, to, width);
  };
  return {move(q, s.qk_width()), move(k, s.qk_width()), move(v, s.v_width()), move(g, s.g_width()),
          move(beta, s.heads)};
}

// The host arrays of n tokens as CpuBackend buffers.
template <class T>
auto host_view(int64_t n) {
  return [n](const T* x, int64_t width) { return to_vector(x, n * width); };
}

// One GDN call's forward on CPU ranks: the inputs moved into the plan's layout, the runtime (which keeps the states
// each run started from for its backward) and y in the plan's layout. Built in place: the runtime keeps pointers to
// `be` and `in`.
template <class T>
struct CpuGdnRun final : KeyCore::SavedGdn {
  GdnShape shape;
  Ownership owners;
  CpuBackend<T> be;
  GdnArrays<std::vector<T>> in;
  GdnCP<CpuBackend<T>> gdn;
  std::vector<T> y;
  CpuGdnRun(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnShape& s, const Ownership& layout,
            int64_t n, const T* q, const T* k, const T* v, const T* g, const T* beta)
      : shape(s),
        owners(gdn_ownership(row, plan)),
        in(gdn_arrays(comm, be, layout, owners, shape, host_view<T>(n), q, k, v, g, beta)),
        gdn(plan, row, shape, comm, be),
        y(static_cast<size_t>(gdn.owned_rows() * shape.v_width())) {
    gdn.forward(in.q, in.k, in.v, in.g, in.beta, y);
  }
};

// A DenseAttentionCP and the backend it runs on, built once per shape. Autograd calls the stateless
// backward, which fetches remote KV again, so the forward keeps none of it (Refetch).
template <class T>
struct AttentionRunner {
  CpuBackend<T> backend;
  DenseAttentionCP<CpuBackend<T>> cp;
  AttentionRunner(const Plan& plan, const Row& row, const AttentionCall& c, Communicator& comm)
      : cp(plan, row, attention_shape(c, plan.window), comm, backend, DenseAttentionOptions{BackwardKv::Refetch}) {}
};

}  // namespace

struct KeyCore::Runners {
  std::map<AttentionCall, std::unique_ptr<AttentionRunner<float>>> f32;
  std::map<AttentionCall, std::unique_ptr<AttentionRunner<double>>> f64;
};

KeyCore::KeyCore(Row row, Plan plan, std::unique_ptr<Communicator> comm)
    : row_(std::move(row)), plan_(std::move(plan)), comm_(std::move(comm)), runners_(std::make_unique<Runners>()) {
  require(plan_.cp == comm_->size(), "key: the plan is for ", plan_.cp, " ranks but the group has ", comm_->size());
  validate_plan(plan_, row_, plan_.window, comm_->size());
  layout_ = plan_ownership(plan_);
  owned_tokens_ = plan_.ranks[static_cast<size_t>(comm_->rank())].owned_tokens();
}

#if TREECP_HAVE_CUDA
// One CUDA backend per key (its stream and caching pool) and a DenseAttentionCP per shape.
struct KeyCore::CudaRunners {
  int device = -1;
  std::unique_ptr<CudaBackend> backend;
  // The one-rank communicator of CUDA calls without NCCL: it moves its parts on the backend's stream (the
  // key's own self communicator memmoves, which on device addresses would crash the host).
  std::unique_ptr<Communicator> self;
  std::map<AttentionCall, std::unique_ptr<DenseAttentionCP<CudaBackend>>> cp;
  NcclCommunicator* nccl = nullptr;  // set by use_nccl; then the runners above communicate over it
};
#else
struct KeyCore::CudaRunners {};
#endif

KeyCore::~KeyCore() = default;

std::vector<int64_t> KeyCore::owned_index() const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(owned_tokens_));
  for (const TokenRange& t : layout_[static_cast<size_t>(rank())])
    for (int64_t i = t.begin; i < t.end; ++i) out.push_back(i);
  return out;
}

template <class T>
auto& KeyCore::attention_runner(const AttentionCall& c) {
  auto& cache = [this]() -> auto& {
    if constexpr (sizeof(T) == 8) return runners_->f64;
    else return runners_->f32;
  }();
  auto it = cache.find(c);
  if (it == cache.end()) it = cache.emplace(c, std::make_unique<AttentionRunner<T>>(plan_, row_, c, *comm_)).first;
  return *it->second;
}

template <class T>
void KeyCore::attention_forward(const AttentionCall& c, const T* q, const T* k, const T* v, const T* sink, T* y,
                                T* lse, T* o_presink) {
  AttentionRunner<T>& run = attention_runner<T>(c);
  const int64_t n = owned_tokens_;
  const std::vector<T> qb = to_vector(q, n * c.hq * c.d), kb = to_vector(k, n * c.hkv * c.d),
                       vb = to_vector(v, n * c.hkv * c.dv);
  const std::vector<T> sb = sink ? to_vector(sink, c.hq) : std::vector<T>();
  std::vector<T> yb(static_cast<size_t>(n * c.hq * c.dv)), lb(static_cast<size_t>(n * c.hq)), ob;
  if (sink) ob.resize(yb.size());
  run.cp.forward(qb, kb, vb, sink ? &sb : nullptr, yb, lb, sink ? &ob : nullptr);
  copy_out(yb, y);
  copy_out(lb, lse);
  if (sink) copy_out(ob, o_presink);
}

template <class T>
void KeyCore::attention_backward(const AttentionCall& c, const T* q, const T* k, const T* v, const T* sink,
                                 const T* o, const T* lse, const T* dy, T* dq, T* dk, T* dv, T* dsink) {
  AttentionRunner<T>& run = attention_runner<T>(c);
  const int64_t n = owned_tokens_;
  const std::vector<T> qb = to_vector(q, n * c.hq * c.d), kb = to_vector(k, n * c.hkv * c.d),
                       vb = to_vector(v, n * c.hkv * c.dv), ob = to_vector(o, n * c.hq * c.dv),
                       lb = to_vector(lse, n * c.hq), dyb = to_vector(dy, n * c.hq * c.dv);
  const std::vector<T> sb = sink ? to_vector(sink, c.hq) : std::vector<T>();
  std::vector<T> dqb(qb.size()), dkb(kb.size()), dvb(vb.size()), dsb(sb.size(), T(0));
  run.cp.backward(qb, kb, vb, sink ? &sb : nullptr, ob, lb, dyb, dqb, dkb, dvb, sink ? &dsb : nullptr);
  copy_out(dqb, dq);
  copy_out(dkb, dk);
  copy_out(dvb, dv);
  if (dsink) copy_out(dsb, dsink);
}

#if TREECP_HAVE_CUDA
namespace {

template <class T>
DeviceBuffer<T> device_view(uintptr_t ptr, int64_t n) {
  return DeviceBuffer<T>::wrap(reinterpret_cast<T*>(ptr), n);
}

bool is_host_memory(const void* p) {
  cudaPointerAttributes a{};
  cuda::check_cuda(cudaPointerGetAttributes(&a, p), "key: cudaPointerGetAttributes");
  return a.type == cudaMemoryTypeUnregistered || a.type == cudaMemoryTypeHost;
}

}  // namespace

bool KeyCore::has_cuda() { return true; }

uintptr_t KeyCore::cuda_stream(int device) {
  if (!cuda_) cuda_ = std::make_unique<CudaRunners>();
  if (!cuda_->backend) {
    cuda::check_cuda(cudaSetDevice(device), "key: cudaSetDevice");
    cuda_->device = device;
    cuda_->backend = std::make_unique<CudaBackend>();
    cudaStream_t stream = cuda_->backend->stream();
    cuda_->self = make_self_communicator({[stream](void* dst, const void* src, size_t bytes) {
      if (is_host_memory(dst) && is_host_memory(src)) {
        std::memmove(dst, src, bytes);  // an agreement's host words: no device work to order after
        return;
      }
      cuda::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "key: one-rank exchange");
    }});
  }
  require(cuda_->device == device, "key: its CUDA state is on device ", cuda_->device, ", the tensors on ", device,
          " (one key per device)");
  return reinterpret_cast<uintptr_t>(cuda_->backend->stream());
}

// The key's NCCL communicator when it has one (bound to this key's stream for the call: keys of one group
// share the communicator, each has its own backend and stream), else, at one rank, the CUDA self communicator.
Communicator& KeyCore::cuda_comm(int device, const char* op, bool fp16) {
  cuda_stream(device);
  cuda::check_cuda(cudaSetDevice(device), "key: cudaSetDevice");
  // one backend serves every call of the key; a call's work is enqueued with the dtype it set
  cuda_->backend->set_dtype(fp16 ? cuda::DType::kF16 : cuda::DType::kBf16);
#if TREECP_HAVE_NCCL
  if (cuda_->nccl) {
    require(cuda_->nccl->device() == device, "key: its NCCL communicator is on device ", cuda_->nccl->device(),
            ", the tensors on ", device);
    cuda_->nccl->set_compute_stream(cuda_->backend->stream());
    return *cuda_->nccl;
  }
#endif
  require(comm_->size() == 1, op, ": CUDA tensors under CP (a group of ", comm_->size(),
          ") need the key's NCCL communicator (KeyCore.use_nccl); the group's own communicator moves host memory");
  return *cuda_->self;
}

// The CUDA runner of one shape, over the communicator of the key's CUDA calls, for activations of either dtype.
auto& KeyCore::cuda_runner(const AttentionCall& c, int device, bool fp16) {
  Communicator& comm = cuda_comm(device, "attention", fp16);
  auto& slot = cuda_->cp[c];
  if (!slot)
    slot = std::make_unique<DenseAttentionCP<CudaBackend>>(plan_, row_, attention_shape(c, plan_.window), comm,
                                                           *cuda_->backend, DenseAttentionOptions{BackwardKv::Refetch});
  return *slot;
}

void KeyCore::cuda_attention_forward(const AttentionCall& c, int device, bool fp16, uintptr_t q, uintptr_t k,
                                     uintptr_t v, uintptr_t sink, uintptr_t y, uintptr_t lse, uintptr_t o_presink) {
  auto& runner = cuda_runner(c, device, fp16);
  const int64_t n = owned_tokens_;
  using E = cuda::bf16_t;
  const auto qb = device_view<E>(q, n * c.hq * c.d), kb = device_view<E>(k, n * c.hkv * c.d),
             vb = device_view<E>(v, n * c.hkv * c.dv);
  const auto sb = device_view<float>(sink, c.hq);
  auto yb = device_view<E>(y, n * c.hq * c.dv), ob = device_view<E>(o_presink, n * c.hq * c.dv);
  auto lb = device_view<float>(lse, n * c.hq);
  runner.forward(qb, kb, vb, sink ? &sb : nullptr, yb, lb, sink ? &ob : nullptr);
}

void KeyCore::cuda_attention_backward(const AttentionCall& c, int device, bool fp16, uintptr_t q, uintptr_t k,
                                      uintptr_t v, uintptr_t sink, uintptr_t o, uintptr_t lse, uintptr_t dy,
                                      uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t dsink) {
  auto& runner = cuda_runner(c, device, fp16);
  const int64_t n = owned_tokens_;
  using E = cuda::bf16_t;
  const auto qb = device_view<E>(q, n * c.hq * c.d), kb = device_view<E>(k, n * c.hkv * c.d),
             vb = device_view<E>(v, n * c.hkv * c.dv), obuf = device_view<E>(o, n * c.hq * c.dv),
             dyb = device_view<E>(dy, n * c.hq * c.dv);
  const auto sb = device_view<float>(sink, c.hq), lb = device_view<float>(lse, n * c.hq);
  auto dqb = device_view<float>(dq, n * c.hq * c.d), dkb = device_view<float>(dk, n * c.hkv * c.d),
       dvb = device_view<float>(dv, n * c.hkv * c.dv), dsb = device_view<float>(dsink, c.hq);
  runner.backward(qb, kb, vb, sink ? &sb : nullptr, obuf, lb, dyb, dqb, dkb, dvb, sink ? &dsb : nullptr);
}
#endif

#if TREECP_HAVE_CUDA && TREECP_HAVE_NCCL
bool KeyCore::has_nccl() { return true; }

void KeyCore::use_nccl(NcclCommunicator& comm) {
  if (!cuda_) cuda_ = std::make_unique<CudaRunners>();
  if (cuda_->nccl == &comm) return;
  require(cuda_->nccl == nullptr && cuda_->cp.empty(),
          "key: its CUDA runtimes already communicate over another communicator (use_nccl once, before CUDA calls)");
  require(comm.size() == plan_.cp && comm.rank() == rank(), "key: the NCCL communicator is rank ", comm.rank(), " of ",
          comm.size(), ", the key's plan rank ", rank(), " of ", plan_.cp);
  require(cuda_->device < 0 || cuda_->device == comm.device(), "key: its CUDA state is on device ", cuda_->device,
          ", the NCCL communicator on ", comm.device());
  cuda_->nccl = &comm;
}
#else
bool KeyCore::has_nccl() { return false; }
void KeyCore::use_nccl(NcclCommunicator&) { fail("key: this build of treecp has no NCCL (CUDA CP needs it)"); }
#endif

#if !TREECP_HAVE_CUDA
bool KeyCore::has_cuda() { return false; }
uintptr_t KeyCore::cuda_stream(int) { fail("key: this build of treecp has no CUDA backend"); }
void KeyCore::cuda_attention_forward(const AttentionCall&, int, bool, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                     uintptr_t, uintptr_t, uintptr_t) {
  fail("attention: this build of treecp has no CUDA backend");
}
void KeyCore::cuda_attention_backward(const AttentionCall&, int, bool, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                      uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t) {
  fail("attention: this build of treecp has no CUDA backend");
}
#endif

const GdnPlan& KeyCore::gdn_plan(const GdnCall& c, int element_bytes) {
  const auto key = std::make_tuple(c.heads, c.dk, c.dv, c.per_channel_gate, element_bytes, c.chunk);
  auto it = gdn_plans_.find(key);
  if (it == gdn_plans_.end()) {
    GdnCostModel model;
    model.state_bytes_per_element = element_bytes;  // states and summaries travel in the call's precision
    // The layer's tokens arrive in the attention layout and go back to it: the searched layout prices
    // that move (in the state precision: an upper bound for bf16 activations) and may run in it.
    GdnPlanOptions options;
    options.attention = layout_;
    options.activation_bytes_per_element = element_bytes;
    it = gdn_plans_.emplace(key, plan_gdn(row_, cp(), gdn_shape(c), model, options)).first;
  }
  return it->second;
}

KeyCore::GdnSaveKey KeyCore::gdn_save_key(const GdnCall& c, int kind, uintptr_t q, uintptr_t k, uintptr_t v,
                                          uintptr_t g, uintptr_t beta) {
  return {c.heads, c.dk, c.dv, c.per_channel_gate, c.scale, c.chunk, c.precision, c.fla_split, kind, q, k, v, g, beta};
}

void KeyCore::keep_gdn(const GdnSaveKey& key, std::unique_ptr<SavedGdn> run) {
  const std::lock_guard<std::mutex> hold(gdn_saved_mu_);
  const uint64_t id = ++gdn_serial_;
  for (SavedEntry& e : gdn_saved_)
    if (e.key == key) {  // a forward of the same call on the same inputs again: its run replaces the older one
      gdn_dropped_.push_back(std::move(e.run));
      e.run = std::move(run);
      e.id = id;
      return;
    }
  gdn_saved_.push_back({key, id, std::move(run)});
}

uint64_t KeyCore::last_gdn_saved() const {
  const std::lock_guard<std::mutex> hold(gdn_saved_mu_);
  return gdn_serial_;
}

std::unique_ptr<KeyCore::SavedGdn> KeyCore::take_gdn(const GdnSaveKey& key) {
  const std::lock_guard<std::mutex> hold(gdn_saved_mu_);
  for (auto it = gdn_saved_.begin(); it != gdn_saved_.end(); ++it)
    if (it->key == key) {
      std::unique_ptr<SavedGdn> run = std::move(it->run);
      gdn_saved_.erase(it);
      return run;
    }
  return nullptr;
}

void KeyCore::free_dropped_gdn() {
  std::vector<std::unique_ptr<SavedGdn>> dropped;
  {
    const std::lock_guard<std::mutex> hold(gdn_saved_mu_);
    dropped.swap(gdn_dropped_);
  }
}  // freed here, outside the lock

void KeyCore::drop_gdn_saved(uint64_t id) {
  const std::lock_guard<std::mutex> hold(gdn_saved_mu_);
  for (auto it = gdn_saved_.begin(); it != gdn_saved_.end(); ++it)
    if (it->id == id) {
      gdn_dropped_.push_back(std::move(it->run));
      gdn_saved_.erase(it);
      return;
    }
}

int64_t KeyCore::gdn_saved_count() const {
  const std::lock_guard<std::mutex> hold(gdn_saved_mu_);
  return static_cast<int64_t>(gdn_saved_.size());
}

namespace {
template <class... P>
KeyCore::GdnSaveKey host_save_key(const GdnCall& c, int kind, const P*... x) {
  return KeyCore::gdn_save_key(c, kind, reinterpret_cast<uintptr_t>(x)...);
}
}  // namespace

template <class T>
void KeyCore::gdn_forward(const GdnCall& c, const T* q, const T* k, const T* v, const T* g, const T* beta, T* y) {
  free_dropped_gdn();
  const GdnPlan& plan = gdn_plan(c, static_cast<int>(sizeof(T)));
  auto run = std::make_unique<CpuGdnRun<T>>(*comm_, row_, plan, gdn_shape(c), layout_, owned_tokens_, q, k, v, g, beta);
  copy_out(redistribute(*comm_, run->be, run->y, run->owners, layout_, run->shape.v_width()), y);
  if (c.keep) keep_gdn(host_save_key(c, sizeof(T), q, k, v, g, beta), std::move(run));
}

template <class T>
void KeyCore::gdn_backward(const GdnCall& c, const T* q, const T* k, const T* v, const T* g, const T* beta,
                           const T* dy, T* dq, T* dk, T* dv, T* dg, T* dbeta) {
  free_dropped_gdn();
  // The backward needs the states the forward started each run from: a kept forward's run (GdnCall::keep), else the
  // forward again, as for attention.
  std::unique_ptr<SavedGdn> kept = c.keep ? take_gdn(host_save_key(c, sizeof(T), q, k, v, g, beta)) : nullptr;
  std::unique_ptr<CpuGdnRun<T>> run(
      kept ? static_cast<CpuGdnRun<T>*>(kept.release())  // the key's kind (sizeof(T)) says it is one
           : new CpuGdnRun<T>(*comm_, row_, gdn_plan(c, static_cast<int>(sizeof(T))), gdn_shape(c), layout_,
                              owned_tokens_, q, k, v, g, beta));
  const GdnShape& shape = run->shape;
  const Ownership& owners = run->owners;
  CpuBackend<T>& be = run->be;
  const GdnArrays<std::vector<T>>& in = run->in;
  const std::vector<T> dyg =
      redistribute(*comm_, be, to_vector(dy, owned_tokens_ * shape.v_width()), layout_, owners, shape.v_width());
  std::vector<T> gq(in.q.size()), gk(in.k.size()), gv(in.v.size()), gg(in.g.size()), gb(in.beta.size());
  run->gdn.backward(dyg, gq, gk, gv, gg, gb);
  copy_out(redistribute(*comm_, be, gq, owners, layout_, shape.qk_width()), dq);
  copy_out(redistribute(*comm_, be, gk, owners, layout_, shape.qk_width()), dk);
  copy_out(redistribute(*comm_, be, gv, owners, layout_, shape.v_width()), dv);
  copy_out(redistribute(*comm_, be, gg, owners, layout_, shape.g_width()), dg);
  copy_out(redistribute(*comm_, be, gb, owners, layout_, int64_t{shape.heads}), dbeta);
}

template <class T>
void KeyCore::conv_forward(int channels, int width, bool silu, const T* x, const T* weight, const T* bias, T* y) {
  CpuBackend<T> be;
  ConvCP<CpuBackend<T>> conv(layout_, row_, ConvShape{channels, width, silu}, *comm_, be);
  const std::vector<T> xb = to_vector(x, owned_tokens_ * channels), wb = to_vector(weight, int64_t{channels} * width);
  const std::vector<T> bb = bias ? to_vector(bias, channels) : std::vector<T>();
  std::vector<T> yb(xb.size());
  conv.forward(xb, wb, bias ? &bb : nullptr, yb);
  copy_out(yb, y);
}

template <class T>
void KeyCore::conv_backward(int channels, int width, bool silu, const T* x, const T* weight, const T* bias,
                            const T* dy, T* dx, T* dweight, T* dbias) {
  CpuBackend<T> be;
  ConvCP<CpuBackend<T>> conv(layout_, row_, ConvShape{channels, width, silu}, *comm_, be);
  const std::vector<T> xb = to_vector(x, owned_tokens_ * channels), wb = to_vector(weight, int64_t{channels} * width);
  const std::vector<T> bb = bias ? to_vector(bias, channels) : std::vector<T>();
  std::vector<T> yb(xb.size());
  conv.forward(xb, wb, bias ? &bb : nullptr, yb);  // the backward reads the halo the forward brought
  std::vector<T> dxb(xb.size()), dw(wb.size()), db(bb.size());
  conv.backward(to_vector(dy, owned_tokens_ * channels), dxb, dw, bias ? &db : nullptr);
  copy_out(dxb, dx);
  // The runtime hands every rank the gradient summed over ranks; the package's contract for weights
  // replicated across CP ranks is this rank's share (the caller sums them, as for projections and the sink).
  const T share = T(1) / static_cast<T>(cp());
  for (size_t i = 0; i < dw.size(); ++i) dweight[i] = dw[i] * share;
  if (dbias)
    for (int i = 0; i < channels; ++i) dbias[i] = db[static_cast<size_t>(i)] * share;
}

#if TREECP_HAVE_CUDA
namespace {

// The CUDA backend's GDN states and summaries are fp32, whatever the activations' precision.
constexpr int kCudaGdnStateBytes = 4;

// The caller's 16-bit (bf16 or fp16) device arrays of n tokens as backend buffers.
auto bf16_view(int64_t n) {
  return [n](uintptr_t x, int64_t width) { return device_view<cuda::bf16_t>(x, n * width); };
}

// One call's GDN forward on CUDA: the inputs moved from the key's layout (views of the caller's bf16 arrays
// of n tokens) into the plan's, and y in the plan's layout: the caller's y_out itself where that layout is the key's
// (`in_place`; y_out 0: a buffer of its own). Built in place: the runtime keeps pointers to `in`.
struct CudaGdnRun {
  GdnShape shape;
  Ownership owners;
  bool in_place;  // the plan's ownership is the key's: nothing moves
  GdnArrays<CudaBackend::Act> in;
  GdnCP<CudaBackend> cp;
  CudaBackend::Act y;

  CudaGdnRun(Communicator& comm, CudaBackend& be, const Row& row, const GdnPlan& plan, const GdnShape& s,
             const Ownership& layout, int64_t n, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g, uintptr_t beta,
             uintptr_t y_out = 0)
      : shape(s),
        owners(gdn_ownership(row, plan)),
        in_place(owners == layout),
        in(gdn_arrays(comm, be, layout, owners, shape, bf16_view(n), q, k, v, g, beta)),
        cp(plan, row, shape, comm, be),
        y(in_place && y_out ? bf16_view(n)(y_out, shape.v_width()) : be.alloc_act(cp.owned_rows() * shape.v_width())) {
    cp.forward(in.q, in.k, in.v, in.g, in.beta, y);
  }
};

// A CUDA run a forward kept for its backward (GdnCall::keep), with the split's arrays the backend kept for it
// (CudaBackend::set_gdn_keep_forward), which go back to the pool with it.
// The run's arrays in the backend carry its tag (never reused), so that a later run of the same inputs keeps its own.
uint64_t next_gdn_tag() {
  static std::atomic<uint64_t> tags{0};
  return ++tags;
}
struct CudaGdnSaved final : KeyCore::SavedGdn {
  CudaBackend& be;
  uint64_t tag;
  CudaGdnRun run;
  template <class... A>
  CudaGdnSaved(CudaBackend& b, uint64_t t, A&&... a) : be(b), tag(t), run(std::forward<A>(a)...) {}
  ~CudaGdnSaved() override { be.release_gdn_kept(tag); }
};

// The backend's GDN settings while a run is built, restored however that ends: keep (its split forwards keep their
// arrays for the backward, tagged) and y (false: the forward computes the states only).
struct GdnCallSettings {
  CudaBackend& be;
  GdnCallSettings(CudaBackend& b, bool keep, bool y, uint64_t tag) : be(b) {
    be.set_gdn_keep_forward(keep, tag);
    be.set_gdn_forward_y(y);
  }
  ~GdnCallSettings() {
    be.set_gdn_keep_forward(false);
    be.set_gdn_forward_y(true);
  }
};

int cuda_kind(int device, bool fp16) { return -1 - 2 * device - (fp16 ? 1 : 0); }

}  // namespace

void KeyCore::cuda_gdn_forward(const GdnCall& c, int device, bool fp16, uintptr_t q, uintptr_t k, uintptr_t v,
                               uintptr_t g, uintptr_t beta, uintptr_t y) {
  free_dropped_gdn();
  Communicator& comm = cuda_comm(device, "gated_delta_rule", fp16);
  CudaBackend& be = *cuda_->backend;
  be.set_gdn_precision(static_cast<cuda::GdnPrecision>(c.precision));
  be.set_gdn_fla_split(c.fla_split);
  const int64_t n = owned_tokens_;
  std::unique_ptr<CudaGdnSaved> saved;
  {
    const uint64_t tag = next_gdn_tag();
    const GdnCallSettings settings(be, c.keep, true, tag);
    saved = std::make_unique<CudaGdnSaved>(be, tag, comm, be, row_, gdn_plan(c, kCudaGdnStateBytes), gdn_shape(c),
                                           layout_, n, q, k, v, g, beta, y);
  }
  const CudaGdnRun& run = saved->run;
  if (!run.in_place) {  // else y is the caller's
    const int64_t vw = run.shape.v_width();
    CudaBackend::Act out = bf16_view(n)(y, vw);
    redistribute_into(comm, be, run.y, run.owners, layout_, vw, out);
  }
  if (c.keep) keep_gdn(gdn_save_key(c, cuda_kind(device, fp16), q, k, v, g, beta), std::move(saved));
}

void KeyCore::cuda_gdn_backward(const GdnCall& c, int device, bool fp16, uintptr_t q, uintptr_t k, uintptr_t v,
                                uintptr_t g, uintptr_t beta, uintptr_t dy, uintptr_t dq, uintptr_t dk, uintptr_t dv,
                                uintptr_t dg, uintptr_t dbeta) {
  free_dropped_gdn();
  Communicator& comm = cuda_comm(device, "gated_delta_rule", fp16);
  CudaBackend& be = *cuda_->backend;
  be.set_gdn_precision(static_cast<cuda::GdnPrecision>(c.precision));  // the forward's, recomputed: the same choice
  be.set_gdn_fla_split(c.fla_split);  // the states the forward started each run from, as the forward computed them
  const int64_t n = owned_tokens_;
  // The backward needs the states the forward started each run from: a kept forward's run (GdnCall::keep), else the
  // forward again, as on the CPU, without its y (set_gdn_forward_y) and keeping the split's arrays for the backward
  // below (set_gdn_keep_forward: the same inputs, within this call), which then skips their prep and scan. The run
  // gives the kept arrays back to the pool when it goes.
  std::unique_ptr<SavedGdn> kept = c.keep ? take_gdn(gdn_save_key(c, cuda_kind(device, fp16), q, k, v, g, beta)) : nullptr;
  std::unique_ptr<CudaGdnSaved> saved;
  if (kept) {
    saved.reset(static_cast<CudaGdnSaved*>(kept.release()));  // the key's kind (< 0) says it is one
  } else {
    const uint64_t tag = next_gdn_tag();
    const GdnCallSettings settings(be, true, false, tag);
    saved = std::make_unique<CudaGdnSaved>(be, tag, comm, be, row_, gdn_plan(c, kCudaGdnStateBytes), gdn_shape(c),
                                           layout_, n, q, k, v, g, beta);
  }
  CudaGdnRun& run = saved->run;
  const GdnShape& shape = run.shape;
  const int64_t rows = run.cp.owned_rows(), vw = shape.v_width();
  const CudaBackend::Act dyg =
      run.in_place ? bf16_view(n)(dy, vw) : redistribute(comm, be, bf16_view(n)(dy, vw), layout_, run.owners, vw);
  // In place the gradients are the caller's arrays themselves (the runtime overwrites them), else buffers moved back.
  auto grad = [&](uintptr_t dst, int64_t width) {
    return run.in_place ? device_view<float>(dst, n * width) : be.alloc_grad(rows * width);
  };
  CudaBackend::Grad gq = grad(dq, shape.qk_width()), gk = grad(dk, shape.qk_width()), gv = grad(dv, vw),
                    gg = grad(dg, shape.g_width()), gb = grad(dbeta, shape.heads);
  run.cp.backward(dyg, gq, gk, gv, gg, gb);
  be.release_gdn_kept(saved->tag);  // the kept arrays go back to the pool before the gradients travel
  if (run.in_place) return;
  auto back = [&](const CudaBackend::Grad& src, int64_t width, uintptr_t dst) {
    CudaBackend::Grad out = device_view<float>(dst, n * width);
    redistribute_grad_into(comm, be, src, run.owners, layout_, width, out);
  };
  back(gq, shape.qk_width(), dq);
  back(gk, shape.qk_width(), dk);
  back(gv, vw, dv);
  back(gg, shape.g_width(), dg);
  back(gb, shape.heads, dbeta);
}

void KeyCore::cuda_conv_forward(int channels, int width, bool silu, int device, bool fp16, uintptr_t x,
                                uintptr_t weight, uintptr_t bias, uintptr_t y) {
  Communicator& comm = cuda_comm(device, "short_conv", fp16);
  CudaBackend& be = *cuda_->backend;
  ConvCP<CudaBackend> conv(layout_, row_, ConvShape{channels, width, silu}, comm, be);
  const int64_t n = owned_tokens_;
  using E = cuda::bf16_t;
  const auto xb = device_view<E>(x, n * channels), wb = device_view<E>(weight, int64_t{channels} * width),
             bb = device_view<E>(bias, channels);
  auto yb = device_view<E>(y, n * channels);
  conv.forward(xb, wb, bias ? &bb : nullptr, yb);
}

void KeyCore::cuda_conv_backward(int channels, int width, bool silu, int device, bool fp16, uintptr_t x,
                                 uintptr_t weight, uintptr_t bias, uintptr_t dy, uintptr_t dx, uintptr_t dweight,
                                 uintptr_t dbias) {
  Communicator& comm = cuda_comm(device, "short_conv", fp16);
  CudaBackend& be = *cuda_->backend;
  ConvCP<CudaBackend> conv(layout_, row_, ConvShape{channels, width, silu}, comm, be);
  const int64_t n = owned_tokens_;
  using E = cuda::bf16_t;
  const auto xb = device_view<E>(x, n * channels), wb = device_view<E>(weight, int64_t{channels} * width),
             bb = device_view<E>(bias, channels);
  CudaBackend::Act yb = be.alloc_act(n * channels);
  conv.forward(xb, wb, bias ? &bb : nullptr, yb);  // the backward reads the halo the forward brought
  const auto dyb = device_view<float>(dy, n * channels);
  auto dxb = device_view<float>(dx, n * channels), dwb = device_view<float>(dweight, int64_t{channels} * width),
       dbb = device_view<float>(dbias, channels);
  conv.backward(dyb, dxb, dwb, bias ? &dbb : nullptr);
}
#else
void KeyCore::cuda_gdn_forward(const GdnCall&, int, bool, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                               uintptr_t) {
  fail("gated_delta_rule: this build of treecp has no CUDA backend");
}
void KeyCore::cuda_gdn_backward(const GdnCall&, int, bool, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t) {
  fail("gated_delta_rule: this build of treecp has no CUDA backend");
}
void KeyCore::cuda_conv_forward(int, int, bool, int, bool, uintptr_t, uintptr_t, uintptr_t, uintptr_t) {
  fail("short_conv: this build of treecp has no CUDA backend");
}
void KeyCore::cuda_conv_backward(int, int, bool, int, bool, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t,
                                 uintptr_t, uintptr_t) {
  fail("short_conv: this build of treecp has no CUDA backend");
}
#endif

#define TREECP_KEY_INSTANTIATE(T)                                                                                   \
  template void KeyCore::attention_forward<T>(const AttentionCall&, const T*, const T*, const T*, const T*, T*, T*,  \
                                              T*);                                                                  \
  template void KeyCore::attention_backward<T>(const AttentionCall&, const T*, const T*, const T*, const T*,       \
                                               const T*, const T*, const T*, T*, T*, T*, T*);                       \
  template void KeyCore::gdn_forward<T>(const GdnCall&, const T*, const T*, const T*, const T*, const T*, T*);      \
  template void KeyCore::gdn_backward<T>(const GdnCall&, const T*, const T*, const T*, const T*, const T*,         \
                                         const T*, T*, T*, T*, T*, T*);                                             \
  template void KeyCore::conv_forward<T>(int, int, bool, const T*, const T*, const T*, T*);                         \
  template void KeyCore::conv_backward<T>(int, int, bool, const T*, const T*, const T*, const T*, T*, T*, T*);
TREECP_KEY_INSTANTIATE(float)
TREECP_KEY_INSTANTIATE(double)
#undef TREECP_KEY_INSTANTIATE

}  // namespace treecp::py
