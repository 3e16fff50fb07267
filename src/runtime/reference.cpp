#include "runtime/reference.hpp"

#include <cmath>

#include "core/error.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp {

template <class T>
AttentionResult<T> attention_reference(const Row& row, const AttentionProblem<T>& p) {
  const int64_t S = row.tokens();
  const cpu::AttnShape sh{S, S, p.hq, p.hkv, p.d, p.dv};
  sh.validate();
  require(p.window >= 0, "attention: window must be >= 0 (0 = none), got ", p.window);
  const T scale = p.scale == T(0) ? T(1) / std::sqrt(static_cast<T>(p.d)) : p.scale;
  const auto n_o = static_cast<size_t>(S * p.hq * p.dv);
  const auto n_lse = static_cast<size_t>(S * p.hq);

  const std::vector<Slice> slices = row_slices(row, p.window);
  AttentionResult<T> res;
  std::vector<T> o_tok(n_o);
  res.lse.resize(n_lse);
  const auto q = cpu::dense_view(p.q, p.hq, p.d);
  const auto k = cpu::dense_view(p.k, p.hkv, p.d);
  const auto v = cpu::dense_view(p.v, p.hkv, p.dv);
  const auto o_view = cpu::dense_view<const T>(o_tok.data(), p.hq, p.dv);
  const auto lse_view = cpu::dense_view<const T>(res.lse.data(), p.hq, 1);
  cpu::attention_forward(cpu::AttnForwardArgs<T>{sh, q, k, v, cpu::dense_view(o_tok.data(), p.hq, p.dv),
                                       cpu::dense_view(res.lse.data(), p.hq, 1), scale},
                    slices);
  const cpu::SinkArgs<T> sink{S, p.hq, p.dv, p.sink, o_view, lse_view, {}};
  if (p.sink) {
    res.o.resize(n_o);
    cpu::SinkArgs<T> fwd = sink;
    fwd.y = cpu::dense_view(res.o.data(), p.hq, p.dv);
    cpu::sink_forward(fwd);
  } else {
    res.o = o_tok;
  }
  if (!p.dout) return res;

  res.dq.assign(static_cast<size_t>(S * p.hq * p.d), T(0));
  res.dk.assign(static_cast<size_t>(S * p.hkv * p.d), T(0));
  res.dv.assign(static_cast<size_t>(S * p.hkv * p.dv), T(0));
  cpu::AttnBackwardArgs<T> bwd{sh, q, k, v, o_view, lse_view, cpu::dense_view(p.dout, p.hq, p.dv), {},
                          cpu::dense_view(res.dq.data(), p.hq, p.d), cpu::dense_view(res.dk.data(), p.hkv, p.d),
                          cpu::dense_view(res.dv.data(), p.hkv, p.dv), scale};
  std::vector<T> do_tok, dlse;
  if (p.sink) {
    do_tok.resize(n_o);
    dlse.resize(n_lse);
    res.dsink.assign(static_cast<size_t>(p.hq), T(0));
    cpu::sink_backward(cpu::SinkBackwardArgs<T>{sink, cpu::dense_view(p.dout, p.hq, p.dv), cpu::dense_view(do_tok.data(), p.hq, p.dv),
                                      cpu::dense_view(dlse.data(), p.hq, 1), res.dsink.data()});
    bwd.dout = cpu::dense_view<const T>(do_tok.data(), p.hq, p.dv);
    bwd.dlse = cpu::dense_view<const T>(dlse.data(), p.hq, 1);
  }
  cpu::attention_backward(bwd, slices);
  return res;
}

template AttentionResult<float> attention_reference<float>(const Row&, const AttentionProblem<float>&);
template AttentionResult<double> attention_reference<double>(const Row&, const AttentionProblem<double>&);

}  // namespace treecp
