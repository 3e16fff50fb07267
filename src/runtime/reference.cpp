#include "runtime/reference.hpp"

#include <cmath>

#include "core/error.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp {

template <class T>
AttentionResult<T> attention_reference(const Row& row, const AttentionShape& sh, const AttentionInputs<T>& p) {
  sh.validate();
  const int64_t S = row.tokens();
  const auto n_o = static_cast<size_t>(S * sh.o_width());
  const auto n_lse = static_cast<size_t>(S * sh.hq);

  const std::vector<Slice> slices = row_slices(row, sh.window);
  AttentionResult<T> res;
  std::vector<T> o_tok(n_o);
  res.lse.resize(n_lse);
  const auto q = cpu::dense_view(p.q, sh.hq, sh.d);
  const auto k = cpu::dense_view(p.k, sh.hkv, sh.d);
  const auto v = cpu::dense_view(p.v, sh.hkv, sh.dv);
  const auto o_view = cpu::dense_view<const T>(o_tok.data(), sh.hq, sh.dv);
  const auto lse_view = cpu::dense_view<const T>(res.lse.data(), sh.hq, 1);
  cpu::attention_forward(cpu::AttnForwardArgs<T>{sh, S, S, q, k, v, cpu::dense_view(o_tok.data(), sh.hq, sh.dv),
                                                 cpu::dense_view(res.lse.data(), sh.hq, 1)},
                         slices);
  const cpu::SinkArgs<T> sink{S, sh.hq, sh.dv, p.sink, o_view, lse_view, {}};
  if (p.sink) {
    res.o.resize(n_o);
    cpu::SinkArgs<T> fwd = sink;
    fwd.y = cpu::dense_view(res.o.data(), sh.hq, sh.dv);
    cpu::sink_forward(fwd);
  } else {
    res.o = o_tok;
  }
  if (!p.dout) return res;

  res.dq.assign(static_cast<size_t>(S * sh.q_width()), T(0));
  res.dk.assign(static_cast<size_t>(S * sh.k_width()), T(0));
  res.dv.assign(static_cast<size_t>(S * sh.v_width()), T(0));
  cpu::AttnBackwardArgs<T> bwd{sh,
                               S,
                               S,
                               q,
                               k,
                               v,
                               o_view,
                               lse_view,
                               cpu::dense_view(p.dout, sh.hq, sh.dv),
                               {},
                               cpu::dense_view(res.dq.data(), sh.hq, sh.d),
                               cpu::dense_view(res.dk.data(), sh.hkv, sh.d),
                               cpu::dense_view(res.dv.data(), sh.hkv, sh.dv)};
  std::vector<T> do_tok, dlse;
  if (p.sink) {
    do_tok.resize(n_o);
    dlse.resize(n_lse);
    res.dsink.assign(static_cast<size_t>(sh.hq), T(0));
    cpu::sink_backward(cpu::SinkBackwardArgs<T>{sink, cpu::dense_view(p.dout, sh.hq, sh.dv),
                                                cpu::dense_view(do_tok.data(), sh.hq, sh.dv),
                                                cpu::dense_view(dlse.data(), sh.hq, 1), res.dsink.data()});
    bwd.dout = cpu::dense_view<const T>(do_tok.data(), sh.hq, sh.dv);
    bwd.dlse = cpu::dense_view<const T>(dlse.data(), sh.hq, 1);
  }
  cpu::attention_backward(bwd, slices);
  return res;
}

template <class T>
AttentionResult<double> attention_reference_double(const Row& row, const AttentionShape& sh,
                                                   const AttentionInputs<T>& p) {
  if constexpr (sizeof(T) == sizeof(double)) {
    return attention_reference(row, sh, p);
  } else {
    const int64_t S = row.tokens();
    auto widen = [](const T* x, int64_t n) { return x ? std::vector<double>(x, x + n) : std::vector<double>(); };
    const std::vector<double> q = widen(p.q, S * sh.q_width()), k = widen(p.k, S * sh.k_width()),
                              v = widen(p.v, S * sh.v_width()), sink = widen(p.sink, sh.hq),
                              dout = widen(p.dout, S * sh.o_width());
    return attention_reference(row, sh,
                               AttentionInputs<double>{q.data(), k.data(), v.data(), p.sink ? sink.data() : nullptr,
                                                       p.dout ? dout.data() : nullptr});
  }
}

template AttentionResult<double> attention_reference_double<float>(const Row&, const AttentionShape&,
                                                                   const AttentionInputs<float>&);
template AttentionResult<double> attention_reference_double<double>(const Row&, const AttentionShape&,
                                                                    const AttentionInputs<double>&);
template AttentionResult<float> attention_reference<float>(const Row&, const AttentionShape&,
                                                           const AttentionInputs<float>&);
template AttentionResult<double> attention_reference<double>(const Row&, const AttentionShape&,
                                                             const AttentionInputs<double>&);

}  // namespace treecp
