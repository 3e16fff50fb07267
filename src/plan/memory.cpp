#include "plan/memory.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "plan/cost.hpp"

namespace treecp {

namespace {

struct Meter {
  int64_t live = 0, peak = 0;
  void alloc(int64_t b) {
    live += b;
    peak = std::max(peak, live);
  }
  void release(int64_t b) { live -= b; }
};

}  // namespace

RuntimeMemory attention_runtime_memory(const RuntimeMemoryInput& in) {
  const size_t W = in.fetched_rows.size();
  require(in.sent_rows.size() == W, "attention_runtime_memory: ", W, " fetched and ", in.sent_rows.size(),
          " sent wave sizes");
  const int64_t kvw = in.hkv * (in.d + in.dv);
  const int64_t o_bytes = in.owned_rows * in.hq * in.dv * in.act_bytes, l_bytes = in.owned_rows * in.hq * in.stat_bytes;
  auto send = [&](size_t w) { return in.sent_rows[w] * kvw * in.act_bytes; };
  auto kv = [&](size_t w) { return in.fetched_rows[w] * kvw * in.act_bytes; };
  // A wave that fetches nothing runs no kernel and adds no part to the merge.
  size_t live = 0;
  for (size_t w = 0; w < W; ++w) live += in.fetched_rows[w] > 0 ? 1 : 0;
  Meter m;
  // forward (DenseAttentionCP::forward)
  const bool direct = live == 0 && !in.sink;
  if (!direct) {
    m.alloc(o_bytes);
    m.alloc(l_bytes);
  }
  if (W > 0) {
    m.alloc(send(0));
    m.alloc(kv(0));
  }
  for (size_t w = 0; w < W; ++w) {
    m.release(send(w));
    if (w + 1 < W) {
      m.alloc(send(w + 1));
      m.alloc(kv(w + 1));
    }
    if (in.fetched_rows[w] > 0) {
      m.alloc(o_bytes);
      m.alloc(l_bytes);
    }
    if (in.refetch) m.release(kv(w));
  }
  if (!direct) {
    if (in.sink) m.alloc(o_bytes);  // the pre-sink output kept for the backward
    m.release(static_cast<int64_t>(live + 1) * (o_bytes + l_bytes));
  }
  RuntimeMemory out;
  out.forward_peak_bytes = m.peak;
  out.kept_bytes = m.live;
  // backward (DenseAttentionCP::backward_impl), the kept buffers still held
  m.peak = m.live;
  if (in.sink) m.alloc(o_bytes);  // dO of the pre-sink output (without a sink it is dy itself)
  m.alloc(l_bytes);                // dLSE / Dsum
  if (in.refetch && W > 0) {
    m.alloc(send(W - 1));
    m.alloc(kv(W - 1));
  }
  for (size_t w = W; w-- > 0;) {  // the remote waves in reverse, as the simulator prices them
    if (in.refetch) {
      m.release(send(w));
      if (w > 0) {
        m.alloc(send(w - 1));
        m.alloc(kv(w - 1));
      }
    }
    m.alloc(in.fetched_rows[w] * kvw * in.grad_bytes);  // dK|dV of the received rows
    m.release(kv(w));
    m.alloc(in.sent_rows[w] * kvw * in.grad_bytes);  // the returns
  }
  m.release((in.sink ? o_bytes : 0) + l_bytes);
  out.backward_peak_bytes = m.peak;
  return out;
}

RuntimeMemoryInput runtime_memory_input(const AttentionShape& shape, const CostModel& costs, int64_t owned_rows) {
  RuntimeMemoryInput in;
  in.owned_rows = owned_rows;
  in.hq = shape.hq;
  in.hkv = shape.hkv;
  in.d = shape.d;
  in.dv = shape.dv;
  in.sink = true;
  in.act_bytes = costs.kv_bytes_per_element;
  in.stat_bytes = 4;
  in.grad_bytes = costs.dkv_bytes_per_element;
  return in;
}

}  // namespace treecp
