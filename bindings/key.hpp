// What treecp.torch's key holds on the C++ side: a row, its attention plan for this rank's group, the
// communicator of that group, and the runtimes built from them (cached per element type and shape, so
// that every layer with the same geometry reuses them). Tensors arrive as raw host pointers with their
// sizes; the Python layer has checked dtypes, devices, shapes and strides by name before calling.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "comm/communicator.hpp"
#include "plan/plan.hpp"
#include "plan/gdn_plan.hpp"
#include "plan/ownership.hpp"
#include "tree/row.hpp"

namespace treecp {
class NcclCommunicator;  // comm/nccl_communicator.hpp, in builds with NCCL
}

namespace treecp::py {

// Shapes of one attention call: q [n, hq, d], k [n, hkv, d], v [n, hkv, dv] over this rank's owned tokens.
struct AttentionCall {
  int hq = 0, hkv = 0, d = 0, dv = 0;
  double scale = 0.0;  // <= 0: 1/sqrt(d)
  auto tie() const { return std::tie(hq, hkv, d, dv, scale); }
  bool operator<(const AttentionCall& o) const { return tie() < o.tie(); }
};

struct GdnCall {
  int heads = 0, dk = 0, dv = 0;
  bool per_channel_gate = false;  // KDA: g [n, H, dk]; GDN: g [n, H]
  double scale = 1.0;
  int chunk = 64;
  int precision = 0;  // CUDA: cuda::GdnPrecision (0 fp32, 1 bf16_tensor, 2 bf16_tensor_scans); the CPU ignores it
  bool fla_split = false;  // CUDA: CudaBackend::set_gdn_fla_split (the FLA-like forward where the call qualifies)
  // Forward: keep this call's run (its inputs in the plan's layout, the states each run started from and, on CUDA,
  // the split's arrays) for its backward; backward: take a kept run of the same call and inputs, if there is one,
  // instead of running the forward again. Every rank of the key must make the same choice (they do when all run the
  // same program); a kept run no backward takes holds its memory until drop_gdn_saved or the key goes.
  bool keep = false;
};

class KeyCore {
 public:
  KeyCore(Row row, Plan plan, std::unique_ptr<Communicator> comm);
  ~KeyCore();
  KeyCore(const KeyCore&) = delete;
  KeyCore& operator=(const KeyCore&) = delete;

  const Row& row() const { return row_; }
  const Plan& plan() const { return plan_; }
  Communicator& comm() { return *comm_; }
  int rank() const { return comm_->rank(); }
  int cp() const { return comm_->size(); }
  int64_t owned_tokens() const { return owned_tokens_; }
  // Canonical ids of this rank's tokens, in its buffers' order.
  std::vector<int64_t> owned_index() const;
  // Every rank's owned ranges (the attention layout, which conv and GDN calls also start from).
  const Ownership& layout() const { return layout_; }

  // y [n, hq, dv] (sink applied), lse [n, hq]; sink [hq] or null; with a sink, o_presink [n, hq, dv] gets
  // the output before the sink (what the backward takes as o).
  template <class T>
  void attention_forward(const AttentionCall& c, const T* q, const T* k, const T* v, const T* sink, T* y, T* lse,
                         T* o_presink);
  // The stateless backward: the forward's inputs, its output before the sink (y without a sink) and lse,
  // and dy. Overwrites dq, dk, dv; dsink (may be null) gets this rank's contribution.
  template <class T>
  void attention_backward(const AttentionCall& c, const T* q, const T* k, const T* v, const T* sink, const T* o,
                          const T* lse, const T* dy, T* dq, T* dk, T* dv, T* dsink);

  // Inputs in the attention layout; the call moves them to the GDN plan's layout and back.
  template <class T>
  void gdn_forward(const GdnCall& c, const T* q, const T* k, const T* v, const T* g, const T* beta, T* y);
  // Overwrites every gradient.
  template <class T>
  void gdn_backward(const GdnCall& c, const T* q, const T* k, const T* v, const T* g, const T* beta, const T* dy,
                    T* dq, T* dk, T* dv, T* dg, T* dbeta);
  // A run a forward with GdnCall::keep kept (key.cpp; CPU and CUDA alike); a backward takes its own.
  struct SavedGdn {
    virtual ~SavedGdn() = default;
  };
  // A kept run's identity: the call, the element kind (4, 8: CPU float, double; < 0: CUDA, by device and dtype) and the
  // inputs' addresses.
  using GdnSaveKey = std::tuple<int, int, int, bool, double, int, int, bool, int, uintptr_t, uintptr_t, uintptr_t,
                                uintptr_t, uintptr_t>;
  static GdnSaveKey gdn_save_key(const GdnCall& c, int kind, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g,
                                 uintptr_t beta);
  // The id of the run the last forward with keep kept (0: none yet); drop_gdn_saved(id) drops that run if no backward
  // has taken it (ids are never reused, so a later run of the same inputs stays).
  uint64_t last_gdn_saved() const;
  void drop_gdn_saved(uint64_t id);
  int64_t gdn_saved_count() const;

  // CUDA (bf16 or, with fp16, fp16 activations; fp32 sink, LSE and gradients), on device `device` and the key's own stream
  // (cuda_stream(), which the caller orders against its own with events). Pointers are device addresses.
  // Available when has_cuda() (the extension was built with the CUDA backend).
  static bool has_cuda();
  // Whether use_nccl() is available (the extension was built with NCCL).
  static bool has_nccl();
  // CUDA calls communicate over `comm` (rank and size those of the key's plan) from now on: required under
  // CP, optional at one rank. Set once, before the first CUDA call; the caller keeps `comm` alive.
  void use_nccl(NcclCommunicator& comm);
  uintptr_t cuda_stream(int device);
  void cuda_attention_forward(const AttentionCall& c, int device, bool fp16, uintptr_t q, uintptr_t k, uintptr_t v,
                              uintptr_t sink, uintptr_t y, uintptr_t lse, uintptr_t o_presink);
  void cuda_attention_backward(const AttentionCall& c, int device, bool fp16, uintptr_t q, uintptr_t k, uintptr_t v,
                               uintptr_t sink, uintptr_t o, uintptr_t lse, uintptr_t dy, uintptr_t dq, uintptr_t dk,
                               uintptr_t dv, uintptr_t dsink);

  // GDN/KDA on CUDA, shaped as gdn_forward/gdn_backward: bf16 (or, with fp16, fp16) inputs, y and dy; fp32
  // gradients (overwritten).
  void cuda_gdn_forward(const GdnCall& c, int device, bool fp16, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g,
                        uintptr_t beta, uintptr_t y);
  void cuda_gdn_backward(const GdnCall& c, int device, bool fp16, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g,
                         uintptr_t beta, uintptr_t dy, uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t dg,
                         uintptr_t dbeta);
  // The short convolution on CUDA: bf16 (or, with fp16, fp16) x, weight, bias (0: none) and y; fp32 dy and
  // gradients. dweight and dbias get the gradient summed over the ranks (unlike conv_backward's share: the caller
  // divides).
  void cuda_conv_forward(int channels, int width, bool silu, int device, bool fp16, uintptr_t x, uintptr_t weight,
                         uintptr_t bias, uintptr_t y);
  void cuda_conv_backward(int channels, int width, bool silu, int device, bool fp16, uintptr_t x, uintptr_t weight,
                          uintptr_t bias, uintptr_t dy, uintptr_t dx, uintptr_t dweight, uintptr_t dbias);

  // Depthwise causal conv over the tree: x [n, C], weight [C, K], bias [C] or null.
  template <class T>
  void conv_forward(int channels, int width, bool silu, const T* x, const T* weight, const T* bias, T* y);
  // Overwrites dx; dweight, dbias (may be null) get this rank's contribution (their sum over ranks is the gradient).
  template <class T>
  void conv_backward(int channels, int width, bool silu, const T* x, const T* weight, const T* bias, const T* dy,
                     T* dx, T* dweight, T* dbias);

 private:
  struct Runners;
  struct CudaRunners;
  template <class T>
  auto& attention_runner(const AttentionCall& c);
  const GdnPlan& gdn_plan(const GdnCall& c, int element_bytes);
  // CUDA builds: the communicator of the key's CUDA calls on `device` (op names the caller in errors; the backend's
  // activations become fp16 or bf16 for the call), and the CUDA runner of one attention call's shape over it.
  Communicator& cuda_comm(int device, const char* op, bool fp16 = false);
  auto& cuda_runner(const AttentionCall& c, int device, bool fp16);

  Row row_;
  Plan plan_;
  std::unique_ptr<Communicator> comm_;
  Ownership layout_;
  int64_t owned_tokens_ = 0;
  std::unique_ptr<Runners> runners_;
  std::unique_ptr<CudaRunners> cuda_;
  std::map<std::tuple<int, int, int, bool, int, int>, GdnPlan> gdn_plans_;  // heads, dk, dv, KDA, bytes, chunk
  // Runs kept by forwards with GdnCall::keep (key.cpp's SavedGdn), by call, element kind and input addresses; after
  // cuda_, so that they go first (a CUDA run refers to the backend).
  struct SavedEntry {
    GdnSaveKey key;
    uint64_t id;
    std::unique_ptr<SavedGdn> run;
  };
  std::vector<SavedEntry> gdn_saved_;
  uint64_t gdn_serial_ = 0;
  // drop_gdn_saved may come from another thread (a Python finalizer, while autograd's thread runs a backward): it
  // only moves runs here, under the lock; the next GDN call, on the ops' thread, frees them.
  std::vector<std::unique_ptr<SavedGdn>> gdn_dropped_;
  mutable std::mutex gdn_saved_mu_;
  void keep_gdn(const GdnSaveKey& key, std::unique_ptr<SavedGdn> run);
  std::unique_ptr<SavedGdn> take_gdn(const GdnSaveKey& key);
  void free_dropped_gdn();  // every GDN call starts with it
};

}  // namespace treecp::py
