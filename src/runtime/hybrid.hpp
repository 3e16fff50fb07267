// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Hybrid stacks (attention and GDN/KDA layers in one model, as in Qwen3-Next and Kimi Linear) over one
// packed row, generic over a Backend and a Communicator.
//
// Islands. Each layer kind runs in its own ownership: every attention layer of the row in the one
// ownership of the attention plans (layers with other windows get plan_for_ownership(), plan/planner.hpp,
// so they move no activation between them), every GDN layer in the GDN plan's (local units and chain
// cuts, plan/gdn_plan.hpp). The activations change ownership only where the kind changes, by one
// redistribute() (runtime/redistribute.hpp): consecutive layers of one kind (an island) keep their
// layout, and the stack's input and output stay in the caller's ownership (the data loader's).
//
// The stack is the smallest model that chains the two kinds: a layer's input is the previous layer's
// output h [S, C] (no projections, no residual: those are token-local and belong to the framework).
//   attention: q = k = v = h viewed as [S, H, D] (hq = hkv = H, d = dv = D, H D = C), y = attention
//   GDN/KDA:   u = conv1d(h) (depthwise over the C channels along logical paths, the layer's weight and
//              bias), q = k = l2norm(u) per head (as GDN layers normalise q and k: it keeps the delta
//              rule contractive), v = u, viewed as [S, H, D], the layer's gates g and beta, y = GDN
// The backward runs the layers in reverse: dh = dq + dk + dv (attention); du = dv + l2norm'(dq + dk),
// then the convolution's backward (GDN). Weight gradients (conv weight, bias) are summed over the ranks; gate
// gradients are per token, in the caller's ownership.
#pragma once

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "plan/gdn_plan.hpp"
#include "plan/plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/gdn_cp.hpp"
#include "runtime/redistribute.hpp"
#include "tree/row.hpp"

namespace treecp {

enum class LayerKind { Attention, Gdn };

struct HybridLayer {
  LayerKind kind = LayerKind::Attention;
  AttentionShape attention;  // kind Attention (hq = hkv, d = dv; its window is this layer's)
  GdnShape gdn;              // kind Gdn (dk = dv)
  ConvShape conv;            // kind Gdn: the short convolution before the recurrence (channels = C)
};

// A GDN layer's parameters: the convolution's weight [C, width] and bias [C] (or null), replicated on
// every rank, and the gates g [S, H] (GDN) or [S, H, D] (KDA) and beta [S, H], rows in the stack's
// input ownership.
template <class Buffer>
struct HybridGdnInputs {
  const Buffer* conv_weight = nullptr;
  const Buffer* conv_bias = nullptr;
  const Buffer* g = nullptr;
  const Buffer* beta = nullptr;
};

// Their gradients: dweight and dbias summed over the ranks; dg and dbeta in the input ownership.
template <class Buffer>
struct HybridGdnGrads {
  Buffer conv_weight, conv_bias, g, beta;
};

template <class Backend>
class HybridStackCP {
 public:
  using Buffer = typename Backend::Buffer;
  // The gradient stream between layers feeds each layer's dy (an Act) from the layer above's input
  // gradients (Grads): one buffer type for both (the CPU backend); a GPU stack needs a Grad -> Act
  // conversion the backends do not have yet.
  static_assert(std::is_same_v<typename Backend::Act, typename Backend::Grad>,
                "HybridStackCP needs a Backend whose Act and Grad are one type");

  // attention_plans: one per attention layer, in layer order, all with one ownership (the constructor
  // refuses others), each for its layer's window; gdn_plan: every GDN layer's. input: the ownership of
  // the stack's input, output and gate arrays.
  HybridStackCP(std::vector<HybridLayer> layers, const Row& row, std::vector<Plan> attention_plans, GdnPlan gdn_plan,
                Ownership input, Communicator& comm, Backend& backend)
      : layers_(std::move(layers)), row_(row), attention_plans_(std::move(attention_plans)),
        gdn_plan_(std::move(gdn_plan)), input_(std::move(input)), comm_(comm), be_(backend) {
    std::string problem;
    try {
      check();
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) fail(problem.empty() ? "hybrid stack refused on another rank" : problem);
    if (!attention_plans_.empty()) attention_owner_ = plan_ownership(attention_plans_.front());
    if (gdn_layers_ > 0) gdn_owner_ = gdn_ownership(row_, gdn_plan_);
    // Each layer's executor checks its plan against the row on every rank (and agrees on the verdict).
    state_.resize(layers_.size());
    size_t attention = 0;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const HybridLayer& L = layers_[i];
      LayerState& st = state_[i];
      if (L.kind == LayerKind::Attention) {
        st.attention =
            std::make_unique<DenseAttentionCP<Backend>>(attention_plans_[attention++], row_, L.attention, comm_, be_);
      } else {
        st.conv = std::make_unique<ConvCP<Backend>>(gdn_owner_, row_, L.conv, comm_, be_);
        st.gdn = std::make_unique<GdnCP<Backend>>(gdn_plan_, row_, L.gdn, comm_, be_);
      }
    }
  }

  int64_t width() const { return width_; }
  // Rows of this rank's input, output and gate buffers (its tokens in the input ownership).
  int64_t input_rows() const { return tokens_of(input_[static_cast<size_t>(comm_.rank())]); }
  // Activation redistributions of the last forward (where the ownership changed, the input's and the
  // output's included); the backward makes as many.
  int exchanges() const { return exchanges_; }

  // h [input_rows, C] -> out [input_rows, C]; gdn: one entry per GDN layer, in layer order. The
  // inputs must outlive backward().
  void forward(const Buffer& h, const std::vector<HybridGdnInputs<Buffer>>& gdn, Buffer& out) {
    require(static_cast<int>(gdn.size()) == gdn_layers_, "hybrid: ", gdn_layers_, " GDN layers need parameters, got ",
            gdn.size());
    for (const HybridGdnInputs<Buffer>& p : gdn)
      require(p.conv_weight && p.g && p.beta, "hybrid: a GDN layer needs its conv weight, g and beta");
    gdn_in_ = gdn;
    exchanges_ = 0;
    Stream x{copy(h, input_rows() * width_), &input_};
    size_t gdn_layer = 0;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const HybridLayer& L = layers_[i];
      LayerState& st = state_[i];
      if (L.kind == LayerKind::Attention) {
        exchanges_ += move_to(x, attention_owner_);
        st.input = std::move(x.data);
        const int64_t rows = st.attention->owned_rows();
        // The stateful backward reads the forward's y and lse: they stay in the layer's state.
        st.y = be_.alloc(rows * width_);
        st.lse = be_.alloc(rows * L.attention.hq);
        st.attention->forward(st.input, st.input, st.input, nullptr, st.y, st.lse);
        x.data = copy(st.y, rows * width_);
        continue;
      }
      const HybridGdnInputs<Buffer>& p = gdn[gdn_layer++];
      exchanges_ += move_to(x, gdn_owner_);
      st.input = std::move(x.data);
      st.g = redistribute(comm_, be_, *p.g, input_, gdn_owner_, L.gdn.g_width());
      st.beta = redistribute(comm_, be_, *p.beta, input_, gdn_owner_, L.gdn.heads);
      const int64_t rows = st.conv->owned_rows();
      st.u = be_.alloc(rows * width_);
      st.conv->forward(st.input, *p.conv_weight, p.conv_bias, st.u);
      st.qk = be_.alloc(rows * width_);
      be_.l2norm_forward(st.u, rows * L.gdn.heads, L.gdn.dk, st.qk);
      Buffer y = be_.alloc(rows * width_);
      st.gdn->forward(st.qk, st.qk, st.u, st.g, st.beta, y);
      x.data = std::move(y);
    }
    exchanges_ += move_to(x, input_);
    be_.copy_rows(x.data, {{0, 0, input_rows()}}, width_, out);
  }

  // dout [input_rows, C] -> dh [input_rows, C] (overwritten) and, per GDN layer in layer order, its
  // parameters' gradients (allocated here).
  void backward(const Buffer& dout, Buffer& dh, std::vector<HybridGdnGrads<Buffer>>& gdn_grads) {
    require(static_cast<int>(gdn_in_.size()) == gdn_layers_, "hybrid: backward() called before forward()");
    gdn_grads.clear();
    gdn_grads.resize(static_cast<size_t>(gdn_layers_));
    Stream d{copy(dout, input_rows() * width_), &input_};
    size_t gdn_layer = static_cast<size_t>(gdn_layers_);
    for (size_t i = layers_.size(); i-- > 0;) {
      const HybridLayer& L = layers_[i];
      LayerState& st = state_[i];
      if (L.kind == LayerKind::Attention) {
        move_to(d, attention_owner_);
        const int64_t rows = st.attention->owned_rows();
        Buffer dq = be_.alloc(rows * width_), dk = be_.alloc(rows * width_), dv = be_.alloc(rows * width_);
        st.attention->backward(d.data, dq, dk, dv, nullptr);
        add_into(dq, dk, rows);
        add_into(dq, dv, rows);
        d.data = std::move(dq);
        continue;
      }
      HybridGdnGrads<Buffer>& g = gdn_grads[--gdn_layer];
      const HybridGdnInputs<Buffer>& p = gdn_in_[gdn_layer];
      move_to(d, gdn_owner_);
      const int64_t rows = st.gdn->owned_rows();
      Buffer dq = be_.alloc(rows * width_), dk = be_.alloc(rows * width_), dv = be_.alloc(rows * width_);
      Buffer dg = be_.alloc(rows * L.gdn.g_width()), dbeta = be_.alloc(rows * L.gdn.heads);
      st.gdn->backward(d.data, dq, dk, dv, dg, dbeta);
      add_into(dq, dk, rows);
      be_.l2norm_backward(st.u, dq, rows * L.gdn.heads, L.gdn.dk, dv);  // dv becomes du
      Buffer dx = be_.alloc(rows * width_);
      g.conv_weight = be_.alloc(be_.size(*p.conv_weight));
      if (p.conv_bias) g.conv_bias = be_.alloc(be_.size(*p.conv_bias));
      st.conv->backward(dv, dx, g.conv_weight, p.conv_bias ? &g.conv_bias : nullptr);
      g.g = redistribute(comm_, be_, dg, gdn_owner_, input_, L.gdn.g_width());
      g.beta = redistribute(comm_, be_, dbeta, gdn_owner_, input_, L.gdn.heads);
      d.data = std::move(dx);
    }
    move_to(d, input_);
    be_.copy_rows(d.data, {{0, 0, input_rows()}}, width_, dh);
  }

 private:
  // The activation stream between layers and the ownership it is laid out in.
  struct Stream {
    Buffer data;
    const Ownership* where;
  };
  // What a layer keeps between forward and backward.
  struct LayerState {
    Buffer input, u, qk, g, beta;  // its input (q = k = v for attention); GDN: conv output, l2norm(u), gates
    Buffer y, lse;                 // attention: its output and LSE (the backward reads them)
    std::unique_ptr<DenseAttentionCP<Backend>> attention;
    std::unique_ptr<ConvCP<Backend>> conv;
    std::unique_ptr<GdnCP<Backend>> gdn;
  };

  // Moves the stream into `target`; false inside an island (the layout stays).
  bool move_to(Stream& s, const Ownership& target) {
    if (*s.where == target) return false;
    s.data = redistribute(comm_, be_, s.data, *s.where, target, width_);
    s.where = &target;
    return true;
  }
  Buffer copy(const Buffer& src, int64_t n) {
    Buffer out = be_.alloc(n);
    be_.copy_rows(src, {{0, 0, 1}}, n, out);
    return out;
  }
  void add_into(Buffer& acc, const Buffer& x, int64_t rows) {
    be_.add_rows(x, width_, 0, width_, be_.upload(std::vector<RowCopy>{{0, 0, rows}}), acc);
  }

  void check() {
    require(!layers_.empty(), "hybrid: no layers");
    validate_ownership(input_, row_.tokens());
    require(static_cast<int>(input_.size()) == comm_.size(), "hybrid: the input ownership is for ", input_.size(),
            " ranks, the communicator has ", comm_.size());
    int attention = 0;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const HybridLayer& L = layers_[i];
      int64_t c = 0;
      if (L.kind == LayerKind::Attention) {
        L.attention.validate();
        require(L.attention.hq == L.attention.hkv && L.attention.d == L.attention.dv, "hybrid: layer ", i,
                ": q = k = v needs hq = hkv and d = dv");
        c = L.attention.q_width();
        ++attention;
      } else {
        L.gdn.validate();
        L.conv.validate();
        require(L.gdn.dk == L.gdn.dv, "hybrid: layer ", i, ": q = k = v needs dk = dv");
        c = L.gdn.qk_width();
        require(L.conv.channels == c, "hybrid: layer ", i, ": the convolution has ", L.conv.channels,
                " channels, the layer ", c);
        ++gdn_layers_;
      }
      require(i == 0 || c == width_, "hybrid: layer ", i, " is ", c, " wide, the stack ", width_);
      width_ = c;
    }
    if (gdn_layers_ > 0) {
      require(gdn_plan_.ranks == comm_.size(), "hybrid: the GDN plan is for ", gdn_plan_.ranks,
              " ranks, the communicator has ", comm_.size());
      validate_gdn_plan(row_, gdn_plan_);
    }
    require(static_cast<int>(attention_plans_.size()) == attention, "hybrid: ", attention,
            " attention layers need as many plans, got ", attention_plans_.size());
    for (size_t a = 1; a < attention_plans_.size(); ++a) {
      require(plan_ownership(attention_plans_[a]) == plan_ownership(attention_plans_[0]), "hybrid: attention plan ",
              a, " has another ownership than plan 0 (plan it with plan_for_ownership)");
    }
  }

  std::vector<HybridLayer> layers_;
  const Row& row_;
  std::vector<Plan> attention_plans_;
  GdnPlan gdn_plan_;
  Ownership input_, attention_owner_, gdn_owner_;
  Communicator& comm_;
  Backend& be_;
  int64_t width_ = 0;
  int gdn_layers_ = 0;
  int exchanges_ = 0;
  std::vector<HybridGdnInputs<Buffer>> gdn_in_;
  std::vector<LayerState> state_;
};

}  // namespace treecp
