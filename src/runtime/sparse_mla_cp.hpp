// Sparse MLA with a learned indexer under context parallelism (ART §07) on one rank, generic over a
// Backend (runtime/backend.hpp) and a Communicator.
//
// Full-index layer: queries stay with their owner. The indexer runs the dense plan's stages (owned
// keys while wave 1's ki travels, then one stage per wave of received ki) and merges each stage's
// top-k list into the running one on canonical ids, so the selection is the same at any rank count,
// layout or arrival order. The sparse call then reads one combined KV buffer
//     [owned rows | rows read from peer 0 | rows read from peer 1 | ...]   (each section sorted by id)
// through a per-query list of its rows (the id -> row map). Remote rows come with the indexer's waves
// (KvFetch::Waves: every fetched kv row travels, overlapped with the indexer) or, requested by id after
// the indexer, from their owners (KvFetch::Selected: only the selected rows travel). Either way the
// owners learn which of their rows were read.
// Shared-index layer (IndexShare): the ids of another layer (canonical, so placement-free), checked on
// every rank; no indexer, rows requested by id.
// Backward: one sparse backward call; dQ stays; the combined buffer's dKV is split at its section
// boundaries and each section goes back to its owner, which adds it into its rows. The indexer receives
// no gradient (the top-k is not differentiable).
//
// Every rank calls every collective in the same order (the same plan and fetch mode everywhere).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "plan/sparse_mla_plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/exchange.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp {

struct SparseMlaTraffic {
  int64_t bytes_sent = 0, bytes_received = 0;  // forward (waves, ids, rows) and backward (dKV), this rank
  int64_t combined_rows = 0;                   // rows of the last sparse call's KV buffer
  int64_t remote_rows = 0;                     // of which read from other ranks
  double forward_ms = 0.0, backward_ms = 0.0;  // wall time of the last calls
};

// Host bookkeeping of one sparse call: which remote rows the owned queries' lists read, where they sit
// in the combined buffer, and each list entry's row. Pure data.
struct CombinedLayout {
  int64_t owned_rows = 0;
  std::vector<std::vector<int64_t>> need;  // per peer: sorted distinct canonical ids read from it (none from self)
  std::vector<int64_t> offset;             // per peer: first combined row of its section
  int64_t rows = 0;                        // owned_rows + every section
  std::vector<int64_t> list_rows;          // per list entry (ids' layout): its combined row, -1 for none
};

// ids: [owned queries, topk] canonical ids (-1 = none), in owned-row order; owners from plan's chunks.
CombinedLayout combine_selected(const std::vector<int64_t>& ids, const RowMap& owned, const Plan& plan, int me);

// Copies between the rows `map` gives sorted canonical `ids` and consecutive rows starting at `first`
// (ids[i] <-> first + i), merged into runs: to_map copies into the map's rows, otherwise out of them.
std::vector<RowCopy> id_runs(const std::vector<int64_t>& ids, const RowMap& map, int64_t first, bool to_map);

// For each wave, the copies of the layout's remote rows from that wave's buffer into the combined buffer.
std::vector<std::vector<RowCopy>> wave_copies(const CombinedLayout& layout, const std::vector<const RowMap*>& fetched);

template <class Backend>
class SparseMlaCP {
 public:
  using Real = typename Backend::Real;
  using Buffer = typename Backend::Buffer;
  using IndexBuffer = typename Backend::IndexBuffer;

  // Checks the plan against the row, the dims and the communicator on every rank and agrees on the
  // verdict before any data moves: a bad plan throws the same error everywhere, no collective hangs.
  SparseMlaCP(const SparseMlaPlan& plan, const Row& row, const SparseMlaDims& dims, Communicator& comm, Backend& backend)
      : plan_(plan), row_(row), dims_(dims), comm_(comm), be_(backend) {
    std::string problem;
    try {
      require(plan.plan.cp == comm.size(), "plan is for ", plan.plan.cp, " ranks but the communicator has ", comm.size());
      validate_plan(plan.plan, row, plan.plan.window, comm.size());
      require(dims.hi > 0 && dims.di > 0 && dims.h > 0 && dims.dqk > 0, "sparse mla: head counts and dims must be > 0");
      require(dims.dv > 0 && dims.dv <= dims.dqk, "sparse mla: dv must be in [1, dqk = ", dims.dqk, "], got ", dims.dv);
      require(dims.topk >= 1, "sparse mla: top-k must be >= 1, got ", dims.topk);
      require(plan.topk == dims.topk, "sparse mla: the plan was priced for top-k ", plan.topk, ", the layer has ", dims.topk);
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) fail(problem.empty() ? "plan refused on another rank" : problem);
    const RankPlan& mine = plan.plan.ranks[static_cast<size_t>(comm.rank())];
    owned_ = RowMap(mine.owned);
    owned_ids_ = be_.index_from_host(canonical_ids(owned_));
    stage0_slices_ = to_buffer(mine.stages[0].slices, owned_, owned_);
    waves_.resize(static_cast<size_t>(plan.plan.num_waves));
    for (size_t w = 0; w < waves_.size(); ++w) {
      Wave& wave = waves_[w];
      wave.rows = wave_rows(mine.stages[w + 1], owned_, comm.size());
      wave.slices = to_buffer(mine.stages[w + 1].slices, owned_, wave.rows.fetched);
      wave.key_ids = be_.index_from_host(canonical_ids(wave.rows.fetched));
    }
  }

  int64_t owned_rows() const { return owned_.rows(); }
  const RowMap& owned() const { return owned_; }
  const SparseMlaTraffic& traffic() const { return traffic_; }

  // Full-index layer. qi [owned, hi, di], ki [owned, di], w [owned, hi], q [owned, h, dqk], kv [owned, dqk].
  // Writes ids [owned, topk] (canonical, best first, -1 after the last), o [owned, h, dv], lse [owned, h].
  // q must outlive backward().
  void forward(const Buffer& qi, const Buffer& ki, const Buffer& w, const Buffer& q, const Buffer& kv, IndexBuffer& ids,
               Buffer& o, Buffer& lse) {
    const auto t0 = std::chrono::steady_clock::now();
    traffic_.bytes_sent = traffic_.bytes_received = 0;
    const int64_t rows = owned_.rows(), k = dims_.topk;
    const bool kv_in_waves = plan_.fetch == KvFetch::Waves;
    std::vector<std::unique_ptr<Communicator::Pending>> pending;
    if (!waves_.empty()) pending = start_wave(waves_[0], ki, kv_in_waves ? &kv : nullptr);
    Buffer score = be_.alloc(rows * k), part_score = be_.alloc(rows * k);
    ids = be_.index_from_host(std::vector<int64_t>(static_cast<size_t>(rows * k), -1));
    IndexBuffer part_ids = ids;
    be_.indexer_topk(dims_, qi, w, rows, ki, owned_ids_, rows, stage0_slices_, score, ids);
    for (size_t i = 0; i < waves_.size(); ++i) {
      for (auto& p : pending) p->wait();
      pending.clear();
      if (i + 1 < waves_.size()) pending = start_wave(waves_[i + 1], ki, kv_in_waves ? &kv : nullptr);
      Wave& wave = waves_[i];
      wave.send_ki = wave.send_kv = Buffer();
      be_.indexer_topk(dims_, qi, w, rows, wave.ki, wave.key_ids, wave.rows.fetched.rows(), wave.slices, part_score,
                       part_ids);
      be_.topk_merge(score, ids, part_score, part_ids, rows, k);
      wave.ki = Buffer();
    }
    attend(q, kv, ids, kv_in_waves, o, lse);
    traffic_.forward_ms = ms_since(t0);
  }

  // Shared-index layer (IndexShare): ids [owned, topk] of another layer, canonical, checked here on every
  // rank (each entry -1 or a key its query sees, no repeats) before any data moves.
  void forward_shared(const IndexBuffer& ids, const Buffer& q, const Buffer& kv, Buffer& o, Buffer& lse) {
    const auto t0 = std::chrono::steady_clock::now();
    traffic_.bytes_sent = traffic_.bytes_received = 0;
    std::string problem;
    try {
      const std::vector<int64_t> host = be_.index_to_host(ids);
      require(static_cast<int64_t>(host.size()) == owned_.rows() * dims_.topk, "ids: ", host.size(),
              " entries for ", owned_.rows(), " owned queries x top-k ", dims_.topk);
      for (size_t i = 0; i < owned_.ranges().size(); ++i) {
        const TokenRange& t = owned_.ranges()[i];
        cpu::check_selected_ids(row_, plan_.plan.window, dims_.topk, t.begin, t.end,
                                host.data() + owned_.offset(i) * dims_.topk);
      }
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm_.all_ok(problem.empty())) fail(problem.empty() ? "ids refused on another rank" : problem);
    attend(q, kv, ids, false, o, lse);
    traffic_.forward_ms = ms_since(t0);
  }

  // dout [owned, h, dv] -> dq [owned, h, dqk], dkv [owned, dqk] (overwritten): this rank's dKV plus
  // what the ranks that read its rows return.
  void backward(const Buffer& dout, Buffer& dq, Buffer& dkv) {
    require(q_ != nullptr, "backward() called before forward()");
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t rows = owned_.rows(), width = dims_.dqk;
    Buffer dcomb = be_.alloc(layout_.rows * width);
    be_.zero(dq);
    be_.sparse_backward(dims_, *q_, rows, combined_, layout_.rows, list_rows_, o_, lse_, dout, dq, dcomb);
    be_.copy_rows(dcomb, {{0, 0, rows}}, width, dkv);
    // The mirror of the row flow: section p of the combined buffer goes back to peer p.
    const RowExchange x = row_exchange(need_rows_, served_rows_, width, comm_.rank(), sizeof(Real));
    std::vector<int64_t> send_displs = x.send_displs;
    for (size_t p = 0; p < send_displs.size(); ++p) send_displs[p] = layout_.offset[p] * width;
    Buffer returned = be_.alloc(served_total_ * width);
    comm_.all_to_all_v(be_.data(dcomb), x.send_counts, send_displs, be_.data(returned), x.recv_counts, x.recv_displs,
                       Backend::comm_type);
    count(x);
    be_.add_rows(returned, served_runs_, width, dkv);
    traffic_.backward_ms = ms_since(t0);
  }

 private:
  struct Wave {
    WaveRows rows;
    std::vector<Slice> slices;  // buffer coordinates: owned q x fetched k
    IndexBuffer key_ids;        // canonical id of each fetched row
    Buffer send_ki, send_kv, ki, kv;
  };

  static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

  static std::vector<int64_t> canonical_ids(const RowMap& map) {
    std::vector<int64_t> out;
    out.reserve(static_cast<size_t>(map.rows()));
    for (const TokenRange& t : map.ranges()) {
      for (int64_t id = t.begin; id < t.end; ++id) out.push_back(id);
    }
    return out;
  }

  void count(const RowExchange& x) {
    traffic_.bytes_sent += x.bytes_out;
    traffic_.bytes_received += x.bytes_in;
  }

  std::unique_ptr<Communicator::Pending> start(const void* send, void* recv, const RowExchange& x, CommType type) {
    count(x);
    return comm_.start_all_to_all_v(send, x.send_counts, x.send_displs, recv, x.recv_counts, x.recv_displs, type);
  }

  std::vector<std::unique_ptr<Communicator::Pending>> start_wave(Wave& wave, const Buffer& ki, const Buffer* kv) {
    std::vector<std::unique_ptr<Communicator::Pending>> out;
    const int me = comm_.rank();
    auto send = [&](const Buffer& src, int64_t width, Buffer& packed, Buffer& recv) {
      packed = be_.alloc(wave.rows.send_total * width);
      be_.copy_rows(src, wave.rows.pack, width, packed);
      recv = be_.alloc(wave.rows.fetched.rows() * width);
      out.push_back(start(be_.data(packed), be_.data(recv),
                          row_exchange(wave.rows.send_rows, wave.rows.recv_rows, width, me, sizeof(Real)),
                          Backend::comm_type));
    };
    send(ki, dims_.di, wave.send_ki, wave.ki);
    if (kv) send(*kv, dims_.dqk, wave.send_kv, wave.kv);
    return out;
  }

  // The combined buffer and one sparse call over it. kv_in_waves: remote rows are in the waves' buffers;
  // otherwise they are requested from their owners. Either way the owners get the ids (for backward).
  void attend(const Buffer& q, const Buffer& kv, const IndexBuffer& ids, bool kv_in_waves, Buffer& o, Buffer& lse) {
    const int cp = comm_.size(), me = comm_.rank();
    const int64_t rows = owned_.rows(), width = dims_.dqk;
    layout_ = combine_selected(be_.index_to_host(ids), owned_, plan_.plan, me);
    // How many ids each peer asks of this rank, then the ids themselves.
    need_rows_.assign(static_cast<size_t>(cp), 0);
    std::vector<int64_t> need_flat;
    for (int p = 0; p < cp; ++p) {
      need_rows_[static_cast<size_t>(p)] = static_cast<int64_t>(layout_.need[static_cast<size_t>(p)].size());
      need_flat.insert(need_flat.end(), layout_.need[static_cast<size_t>(p)].begin(), layout_.need[static_cast<size_t>(p)].end());
    }
    const std::vector<int64_t> ones(static_cast<size_t>(cp), 1);
    IndexBuffer counts_out = be_.index_from_host(need_rows_), counts_in = be_.index_from_host(std::vector<int64_t>(static_cast<size_t>(cp)));
    start(be_.index_data(counts_out), be_.index_data(counts_in), row_exchange(ones, ones, 1, me, sizeof(int64_t)),
          CommType::I64)->wait();
    served_rows_ = be_.index_to_host(counts_in);
    served_total_ = 0;
    for (int64_t n : served_rows_) served_total_ += n;
    IndexBuffer ids_out = be_.index_from_host(need_flat), ids_in = be_.index_from_host(std::vector<int64_t>(static_cast<size_t>(served_total_)));
    start(be_.index_data(ids_out), be_.index_data(ids_in), row_exchange(need_rows_, served_rows_, 1, me, sizeof(int64_t)),
          CommType::I64)->wait();
    const std::vector<int64_t> served = be_.index_to_host(ids_in);
    // served ids from peer p are sorted: rows of one peer's part map to runs of owned rows
    served_runs_.clear();
    int64_t at = 0;
    for (int p = 0; p < cp; ++p) {
      const int64_t n = served_rows_[static_cast<size_t>(p)];
      const std::vector<int64_t> part(served.begin() + at, served.begin() + at + n);
      for (const RowCopy& c : id_runs(part, owned_, at, true)) served_runs_.push_back(c);
      at += n;
    }
    combined_ = be_.alloc(layout_.rows * width);
    be_.copy_rows(kv, {{0, 0, rows}}, width, combined_);
    if (kv_in_waves) {
      std::vector<const RowMap*> fetched;
      for (const Wave& wave : waves_) fetched.push_back(&wave.rows.fetched);
      const std::vector<std::vector<RowCopy>> copies = wave_copies(layout_, fetched);
      for (size_t i = 0; i < waves_.size(); ++i) {
        be_.copy_rows(waves_[i].kv, copies[i], width, combined_);
        waves_[i].kv = Buffer();
      }
    } else {
      // Serve the rows peers asked for, and receive ours straight into their sections.
      Buffer serve = be_.alloc(served_total_ * width);
      std::vector<RowCopy> gather;
      for (const RowCopy& c : served_runs_) gather.push_back({c.dst_row, c.src_row, c.rows});
      be_.copy_rows(kv, gather, width, serve);
      const RowExchange x = row_exchange(served_rows_, need_rows_, width, me, sizeof(Real));
      std::vector<int64_t> recv_displs = x.recv_displs;
      for (size_t p = 0; p < recv_displs.size(); ++p) recv_displs[p] = layout_.offset[p] * width;
      comm_.all_to_all_v(be_.data(serve), x.send_counts, x.send_displs, be_.data(combined_), x.recv_counts, recv_displs,
                         Backend::comm_type);
      count(x);
    }
    list_rows_ = be_.index_from_host(layout_.list_rows);
    o_ = be_.alloc(rows * dims_.h * dims_.dv);
    lse_ = be_.alloc(rows * dims_.h);
    be_.sparse_forward(dims_, q, rows, combined_, layout_.rows, list_rows_, o_, lse_);
    be_.copy_rows(o_, {{0, 0, rows}}, int64_t{dims_.h} * dims_.dv, o);
    be_.copy_rows(lse_, {{0, 0, rows}}, dims_.h, lse);
    q_ = &q;
    traffic_.combined_rows = layout_.rows;
    traffic_.remote_rows = layout_.rows - rows;
  }

  SparseMlaPlan plan_;
  Row row_;
  SparseMlaDims dims_;
  Communicator& comm_;
  Backend& be_;
  RowMap owned_;
  IndexBuffer owned_ids_;
  std::vector<Slice> stage0_slices_;
  std::vector<Wave> waves_;
  // the last forward, kept for backward
  const Buffer* q_ = nullptr;
  CombinedLayout layout_;
  Buffer combined_, o_, lse_;
  IndexBuffer list_rows_;
  std::vector<int64_t> need_rows_, served_rows_;  // per peer: rows read from it, rows it read here
  int64_t served_total_ = 0;
  std::vector<RowCopy> served_runs_;  // rows of the ids peers read here (packed in peer order) <-> owned rows
  SparseMlaTraffic traffic_;
};

}  // namespace treecp
