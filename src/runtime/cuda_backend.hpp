// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// The CUDA Backend of the runtime (runtime/backend.hpp) over kernels/cuda: bf16 or fp16 activations (dtype()), fp32
// statistics (LSE, Dsum, the sink) and fp32 gradient accumulators, every buffer from a caching device pool,
// every operation enqueued on one compute stream and never waited for by the host. A stage's geometry is a
// device tile plan built once per plan (host lists on any thread, then one copy) and reused by every layer
// of that geometry; the row lists of a wave's pack and dK/dV add are uploaded once per plan too.
//
// The affine-state ops (GDN/KDA CP, runtime/affine_cp.hpp), GDN/KDA itself, the q/k L2 normalisation and the
// short convolution run on kernels/cuda's gdn.hpp and layer_ops.hpp on the backend's dtype() as every other op
// (the chunk kernels on their fp32 products, which fp16 needs), fp32 states, maps and gradients, scratch from the
// pool, one run of the chunk kernels per call.
//
// The element type is a run-time value of the backend, not a template argument: the runtime's protocol classes are
// templates over the Backend, and for them an activation is a 16-bit row to pack, send and hand to the kernels
// either way; a second backend type would compile every one of them twice for nothing. Elem stays the 16-bit
// pattern, and every kernel call passes dtype() (the bindings set it per call: one cached backend serves bf16 and
// fp16 calls; a call's work is enqueued with the dtype it was made under).
//
// Compiled only with CUDA (TREECP_HAVE_CUDA); the attention kernels need sm_90a for their fast paths and (D, Dv) one
// of cuda::kAttentionDims: (64, 64), (128, 128), (192, 128), (256, 256).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/gdn.hpp"
#include "kernels/cuda/layer_ops.hpp"
#include "kernels/cuda/memory.hpp"
#include "runtime/backend.hpp"

namespace treecp {

// A typed device buffer: owning (from a pool, given back on destruction or release) or a view of memory
// someone else owns (wrap(): a framework's tensor).
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(cuda::DevicePool* pool, int64_t n)
      : ptr_(static_cast<T*>(pool->allocate(static_cast<size_t>(n) * sizeof(T)))), n_(n), pool_(pool) {}
  static DeviceBuffer wrap(T* ptr, int64_t n) {
    DeviceBuffer b;
    b.ptr_ = ptr;
    b.n_ = n;
    return b;
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(ptr_, o.ptr_);
      std::swap(n_, o.n_);
      std::swap(pool_, o.pool_);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() { return ptr_; }
  const T* data() const { return ptr_; }
  int64_t size() const { return n_; }
  bool owning() const { return pool_ != nullptr; }
  void reset() {
    if (pool_ && ptr_) pool_->deallocate(ptr_);
    ptr_ = nullptr;
    n_ = 0;
    pool_ = nullptr;
  }

 private:
  T* ptr_ = nullptr;
  int64_t n_ = 0;
  cuda::DevicePool* pool_ = nullptr;
};

class CudaBackend {
 public:
  using Elem = cuda::bf16_t;  // the 16-bit pattern of a bf16 or an fp16 activation (dtype())
  using GradElem = float;
  using Act = DeviceBuffer<cuda::bf16_t>;
  using Stat = DeviceBuffer<float>;
  using Grad = DeviceBuffer<float>;
  using Buffer = Act;
  using HostGeometry = std::shared_ptr<const cuda::TilePlan>;
  using Geometry = std::shared_ptr<cuda::DeviceTilePlan>;
  struct CopyList {
    std::shared_ptr<cuda::DeviceRowList> list;  // given back to the pool with the last copy of the handle
  };
  struct Mark {
    cudaEvent_t event = nullptr;  // owned by the backend
  };
  static constexpr CommType act_comm_type = CommType::BF16;  // 2-byte elements, never reduced: fp16 travels as is
  static constexpr CommType grad_comm_type = CommType::F32;
  static constexpr CommType comm_type = act_comm_type;

  // Works on the current device, enqueuing on `stream` (nullptr: a new non-blocking stream of its own), with
  // activations of `dtype` (bf16 or fp16).
  explicit CudaBackend(cudaStream_t stream = nullptr, cuda::DType dtype = cuda::DType::kBf16);
  ~CudaBackend();
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  cudaStream_t stream() const { return stream_; }
  // Ops enqueue on `stream` from now on (a framework's current stream); the pool is stream-ordered for one
  // stream, so switch only between steps, after the previous stream's work is ordered before the new one's.
  void set_stream(cudaStream_t stream);
  cuda::DevicePool& pool() { return *pool_; }
  // The activations' element type; ops enqueued from now on read and write it (throws unless bf16 or fp16).
  void set_dtype(cuda::DType dtype);
  cuda::DType dtype() const { return dtype_; }
  // The GDN/KDA chunk kernels' arithmetic for ops enqueued from now on (GdnCudaParams::precision): fp32 (the
  // default), or bf16 tensor cores on bf16-rounded products (bf16_tensor: prep and gradients; bf16_tensor_scans:
  // the scans too), faster and less exact (kernels/cpu/bf16_product.hpp). fp16 activations take fp32 only: the
  // kernels refuse the others by name.
  void set_gdn_precision(cuda::GdnPrecision precision);
  cuda::GdnPrecision gdn_precision() const { return gdn_precision_; }
  // The GDN forward and backward as FLA splits them (GdnCudaParams::fla_split: compact prep, the scans' states in
  // registers, chunk-parallel output and gradient kernels; every product bf16 tensor cores) for calls enqueued from
  // now on. Off by default. A request, not a demand: it applies to the calls that qualify (cuda::gdn_fla_split_takes:
  // the scalar gate, dk and dv 64 or 128, bf16 activations, precision bf16_tensor_scans, whose arithmetic the split
  // is); the others (KDA, other head dims, fp16, another precision) run the classic kernels of the current precision,
  // so one setting serves a model whose layers differ. gdn_summary never changes (its own kernels).
  void set_gdn_fla_split(bool on) { gdn_fla_split_ = on; }
  bool gdn_fla_split() const { return gdn_fla_split_; }
  // While on, each GDN forward that runs the FLA-like split keeps its workspace (GdnCudaParams::keep_forward: W, U,
  // the gate's cumulative sum, L⁻¹, the chunk-start states and v_new; 3.5 GB at 40,960 tokens, H = 32, dk = dv = 128)
  // under its inputs and rows, and a split backward of the same inputs and rows (setting on or off) reads them instead
  // of running the split's prep and scan again (2.0 ms of its 7.6 there), and leaves them. For a forward and its
  // backward on unchanged inputs, such as a backward that runs its forward again for the states (the Python op's): a
  // kept entry trusts that q, k, v, g, beta and the state it started from are what they were. A forward of the same
  // inputs and rows replaces the entry; release_gdn_kept gives entries back. Off by default. `owner` tags the entries
  // kept from now on (a later forward of the same inputs and rows takes the entry over, with its own tag).
  void set_gdn_keep_forward(bool on, uint64_t owner = 0) {
    gdn_keep_forward_ = on;
    gdn_keep_owner_ = owner;
  }
  bool gdn_keep_forward() const { return gdn_keep_forward_; }
  // Gives back the kept workspaces tagged `owner` (every one without an argument).
  void release_gdn_kept(uint64_t owner);
  void release_gdn_kept() { gdn_kept_.clear(); }
  // Bytes the kept forwards hold now.
  int64_t gdn_kept_bytes() const;
  // false: GDN forwards compute the final states only and leave y as it is (a backward that runs the forward again
  // for the states wants no y; the split then skips its output kernel). true by default.
  void set_gdn_forward_y(bool on) { gdn_forward_y_ = on; }
  bool gdn_forward_y() const { return gdn_forward_y_; }
  void synchronize();  // host wait for the compute stream

  // ---- memory
  Act alloc(int64_t n) { return alloc_act(n); }
  Act alloc_act(int64_t n) { return Act(pool_.get(), n); }
  Stat alloc_stat(int64_t n) { return Stat(pool_.get(), n); }
  Grad alloc_grad(int64_t n) { return Grad(pool_.get(), n); }
  template <class T>
  void release(DeviceBuffer<T>& b) { b.reset(); }
  int64_t live_bytes() const { return static_cast<int64_t>(pool_->allocated_bytes()); }
  int64_t peak_bytes() const { return static_cast<int64_t>(pool_->peak_allocated_bytes()); }
  void reset_peak() { pool_->reset_peak(); }
  template <class T>
  T* data(DeviceBuffer<T>& b) const { return b.data(); }
  template <class T>
  const T* data(const DeviceBuffer<T>& b) const { return b.data(); }
  template <class T>
  int64_t size(const DeviceBuffer<T>& b) const { return b.size(); }
  void zero(Grad& b);
  // Host <-> device (tests, the CLI): synchronous copies of the whole buffer.
  template <class T>
  void upload(DeviceBuffer<T>& b, const std::vector<T>& host);
  template <class T>
  std::vector<T> download(const DeviceBuffer<T>& b);

  // ---- geometry and row lists
  static HostGeometry prepare_geometry(const std::vector<Slice>& slices, int64_t q_rows, int64_t kv_rows,
                                       const AttentionShape& dims);
  Geometry upload(const HostGeometry& g);
  CopyList upload(const std::vector<RowCopy>& copies);

  // ---- row moves
  template <class T>  // Act and Grad
  void copy_rows(const DeviceBuffer<T>& src, const std::vector<RowCopy>& copies, int64_t width, DeviceBuffer<T>& dst);
  void pack_rows(const Act& src, int64_t src_width, const CopyList& copies, Act& dst, int64_t dst_width,
                 int64_t dst_col);
  void add_rows(const Grad& src, int64_t src_width, int64_t src_col, int64_t cols, const CopyList& copies, Grad& dst);

  // ---- attention
  void attention_forward(const AttentionShape& dims, const Geometry& g, const Act& q, const KvView<Elem>& kv, Act& o,
                         Stat& lse);
  void merge_sink_forward(const AttentionShape& dims, int64_t rows, const std::vector<const Act*>& o_parts,
                          const std::vector<const Stat*>& lse_parts, const Stat* sink, Act& y, Act* o_merged,
                          Stat& lse);
  // dstat is Dsum = dot(dO, O) - dJ/dLSE (the kernels' dsum_ready form).
  const Act& merge_sink_backward(const AttentionShape& dims, int64_t rows, const Act& o, const Stat& lse,
                                 const Stat* sink, const Act& dy, Act& d_o, Stat& dsum, Stat* dsink);
  void attention_backward(const AttentionShape& dims, const Geometry& g, const Act& q, const KvView<Elem>& kv,
                          const Act& o, const Stat& lse, const Act& d_o, const Stat& dsum, Grad& dq,
                          const DkvView<GradElem>& dkv);

  // ---- affine-state recurrences: the summary algebra on fp32 maps (runtime/backend.hpp)
  void affine_identity(const AffineShape& sh, Grad& maps, int64_t item);
  void affine_compose(const AffineShape& sh, int64_t items, Grad& later, const Grad& earlier);
  void affine_seed(const AffineShape& sh, Grad& maps, int64_t item, const Grad* state);
  void affine_adjoint(const AffineShape& sh, const Grad& map, const Grad& a, const Grad* g, Grad& maps, int64_t item);
  void affine_state(const AffineShape& sh, const Grad& maps, int64_t item, Grad& state);

  // ---- GDN / KDA (every head of buffer rows [row, row + rows))
  void gdn_forward(const GdnShape& sh, const GdnInputs<Act>& in, int64_t row, int64_t rows, Grad& state, Act& y);
  void gdn_backward(const GdnShape& sh, const GdnInputs<Act>& in, int64_t row, int64_t rows, const Grad& state_in,
                    const Act& dy, Grad& dstate, const GdnGradients<Grad>& grads);
  void gdn_summary(const GdnShape& sh, const GdnInputs<Act>& in, int64_t row, int64_t rows, Grad& maps, int64_t item);
  void l2norm_forward(const Act& x, int64_t groups, int dim, Act& y);
  void l2norm_backward(const Act& x, const Grad& dy, int64_t groups, int dim, Grad& dx);

  // ---- short convolution (prev: host rows, uploaded per call)
  void conv1d_forward(const ConvShape& sh, const Act& x, const std::vector<int64_t>& prev, int64_t out_rows,
                      const Act& weight, const Act* bias, Act& y);
  void conv1d_backward(const ConvShape& sh, const Act& x, const std::vector<int64_t>& prev, int64_t out_rows,
                       const Act& weight, const Act* bias, const Grad& dy, Grad& dx, Grad& dweight, Grad* dbias);

  // ---- timing: CUDA events on the compute stream
  Mark make_mark();
  void record(Mark& m);
  double elapsed_ms(const Mark& a, const Mark& b);

 private:
  std::unique_ptr<cuda::DevicePool> pool_;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  cuda::DType dtype_ = cuda::DType::kBf16;
  cuda::GdnPrecision gdn_precision_ = cuda::GdnPrecision::fp32;
  bool gdn_fla_split_ = false;
  bool gdn_keep_forward_ = false;
  uint64_t gdn_keep_owner_ = 0;
  bool gdn_forward_y_ = true;
  // A kept forward's workspace (set_gdn_keep_forward), by its call's inputs and rows.
  struct KeptGdn {
    const void* q;
    const void* k;
    const void* v;
    const void* g;
    const void* beta;
    int64_t row, rows;
    Grad workspace;
    size_t bytes;
    uint64_t owner;
  };
  std::vector<KeptGdn> gdn_kept_;
  KeptGdn* gdn_kept(const cuda::GdnCudaParams& p, int64_t row, int64_t rows);
  void* fwd_workspace_ = nullptr;  // the persistent forward's counter and hand-off words
  size_t fwd_workspace_bytes_ = 0;
  std::vector<cudaEvent_t> events_;
  // The chunk kernels' view of a rank's GDN inputs (every array holding the same tokens); no workspace yet.
  cuda::GdnCudaParams gdn_params(const GdnShape& sh, const GdnInputs<Act>& in) const;
  // Checks the arrays and prev on the host and uploads prev into prev_dev.
  cuda::Conv1dDeviceParams conv_params(const ConvShape& sh, const Act& x, const std::vector<int64_t>& prev,
                                       int64_t out_rows, const Act& weight, const Act* bias,
                                       DeviceBuffer<int64_t>& prev_dev);
  // Scratch from the pool, given back when the handle goes (stream order makes that safe at once).
  Grad workspace(int64_t bytes) { return alloc_grad((bytes + 3) / 4); }
  // Device tile plans whose geometry was dropped, reused by the next upload (their allocation with them):
  // a new row per step then costs copies, no cudaMalloc. Shared with the geometries' deleters.
  std::shared_ptr<std::vector<std::unique_ptr<cuda::DeviceTilePlan>>> spare_plans_;
};

// Host bf16 helpers (round to nearest even), for the CLI and tests (cuda::f32_to_bits / bits_to_f32 for either type).
cuda::bf16_t to_bf16(float f);
float from_bf16(cuda::bf16_t h);

}  // namespace treecp
