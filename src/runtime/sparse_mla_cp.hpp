// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
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

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "plan/sparse_mla_plan.hpp"
#include "runtime/backend.hpp"
#include "runtime/rank_schedule.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

namespace treecp {

struct SparseMlaTraffic {
  int64_t bytes_sent = 0, bytes_received = 0;  // forward (waves, ids, rows) and backward (dKV), this rank
  int64_t combined_rows = 0;                   // rows of the last sparse call's KV buffer
  int64_t remote_rows = 0;                     // of which read from other ranks
  double forward_ms = 0.0, backward_ms = 0.0;  // the last calls, measured by the backend's marks
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
  using Act = typename Backend::Act;
  using Stat = typename Backend::Stat;
  using Grad = typename Backend::Grad;
  using IndexBuffer = typename Backend::IndexBuffer;
  using CopyList = typename Backend::CopyList;
  using Mark = typename Backend::Mark;

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
      s_ = make_rank_schedule(plan.plan, comm.rank());
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) fail(problem.empty() ? "plan refused on another rank" : problem);
    owned_ids_ = be_.index_from_host(canonical_ids(s_.owned));
    owned_rows_ = be_.upload(std::vector<RowCopy>{{0, 0, s_.owned_rows()}});
    waves_.resize(s_.waves.size());
    for (size_t w = 0; w < waves_.size(); ++w) {
      waves_[w].key_ids = be_.index_from_host(canonical_ids(s_.waves[w].fetched));
      waves_[w].pack = be_.upload(s_.waves[w].pack);
    }
    for (Mark& m : marks_) m = be_.make_mark();
  }

  ~SparseMlaCP() { release_saved(); }
  SparseMlaCP(const SparseMlaCP&) = delete;
  SparseMlaCP& operator=(const SparseMlaCP&) = delete;

  int64_t owned_rows() const { return s_.owned_rows(); }
  const RowMap& owned() const { return s_.owned; }

  // Bytes and rows of the last forward and backward; times by the backend's marks (may wait for the device).
  SparseMlaTraffic traffic() {
    SparseMlaTraffic t = traffic_;
    if (fwd_timed_) t.forward_ms = be_.elapsed_ms(marks_[0], marks_[1]);
    if (bwd_timed_) t.backward_ms = be_.elapsed_ms(marks_[2], marks_[3]);
    return t;
  }

  // Full-index layer. qi [owned, hi, di], ki [owned, di], w [owned, hi], q [owned, h, dqk], kv [owned, dqk].
  // Writes ids [owned, topk] (canonical, best first, -1 after the last), o [owned, h, dv], lse [owned, h].
  // q, o and lse must stay alive and unchanged until backward() returns.
  void forward(const Act& qi, const Act& ki, const Act& w, const Act& q, const Act& kv, IndexBuffer& ids, Act& o,
               Stat& lse) {
    release_saved();
    be_.record(marks_[0]);
    traffic_ = SparseMlaTraffic{};
    const int64_t rows = owned_rows(), k = dims_.topk;
    const bool kv_in_waves = plan_.fetch == KvFetch::Waves;
    std::unique_ptr<Communicator::Pending> pending;
    if (!waves_.empty()) pending = start_wave(0, ki, kv_in_waves ? &kv : nullptr);
    Stat score = be_.alloc_stat(rows * k), part_score = be_.alloc_stat(rows * k);
    ids = be_.index_from_host(std::vector<int64_t>(static_cast<size_t>(rows * k), -1));
    IndexBuffer part_ids = ids;
    be_.indexer_topk(dims_, qi, w, rows, ki, owned_ids_, rows, s_.local_slices, score, ids);
    for (size_t i = 0; i < waves_.size(); ++i) {
      pending->wait();
      Wave& wave = waves_[i];
      be_.release(wave.send_ki);
      be_.release(wave.send_kv);
      if (i + 1 < waves_.size()) pending = start_wave(i + 1, ki, kv_in_waves ? &kv : nullptr);
      be_.indexer_topk(dims_, qi, w, rows, wave.ki, wave.key_ids, s_.waves[i].fetched.rows(), s_.waves[i].slices,
                       part_score, part_ids);
      be_.topk_merge(score, ids, part_score, part_ids, rows, k);
      be_.release(wave.ki);
    }
    be_.release(score);
    be_.release(part_score);
    attend(q, kv, ids, kv_in_waves, o, lse);
    be_.record(marks_[1]);
    fwd_timed_ = true;
    bwd_timed_ = false;
  }

  // Shared-index layer (IndexShare): ids [owned, topk] of another layer, canonical, checked here on every
  // rank (each entry -1 or a key its query sees, no repeats) before any data moves.
  void forward_shared(const IndexBuffer& ids, const Act& q, const Act& kv, Act& o, Stat& lse) {
    release_saved();
    std::string problem;
    try {
      const std::vector<int64_t> host = be_.index_to_host(ids);
      require(static_cast<int64_t>(host.size()) == owned_rows() * dims_.topk, "ids: ", host.size(),
              " entries for ", owned_rows(), " owned queries x top-k ", dims_.topk);
      for (size_t i = 0; i < s_.owned.ranges().size(); ++i) {
        const TokenRange& t = s_.owned.ranges()[i];
        cpu::check_selected_ids(row_, plan_.plan.window, dims_.topk, t.begin, t.end,
                                host.data() + s_.owned.offset(i) * dims_.topk);
      }
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm_.all_ok(problem.empty())) fail(problem.empty() ? "ids refused on another rank" : problem);
    be_.record(marks_[0]);
    traffic_ = SparseMlaTraffic{};
    attend(q, kv, ids, false, o, lse);
    be_.record(marks_[1]);
    fwd_timed_ = true;
    bwd_timed_ = false;
  }

  // dout [owned, h, dv] -> dq [owned, h, dqk], dkv [owned, dqk] (overwritten): this rank's dKV plus what
  // the ranks that read its rows return.
  void backward(const Act& dout, Grad& dq, Grad& dkv) {
    require(q_ != nullptr, "backward() called before forward()");
    be_.record(marks_[2]);
    const int64_t rows = owned_rows(), width = dims_.dqk;
    Grad dcomb = be_.alloc_grad(layout_.rows * width);
    be_.zero(dcomb);
    be_.zero(dq);
    be_.sparse_backward(dims_, *q_, rows, combined_, layout_.rows, list_rows_, *o_, *lse_, dout, dq, dcomb);
    be_.zero(dkv);
    be_.add_rows(dcomb, width, 0, width, owned_rows_, dkv);
    // The mirror of the row flow: section p of the combined buffer goes back to peer p.
    ExchangeCounts x = exchange_counts(need_rows_, served_rows_, width);
    for (size_t p = 0; p < x.send_displs.size(); ++p) x.send_displs[p] = layout_.offset[p] * width;
    Grad returned = be_.alloc_grad(served_total_ * width);
    start(be_.data(dcomb), be_.data(returned), x, Backend::grad_comm_type)->wait();
    be_.release(dcomb);
    be_.add_rows(returned, width, 0, width, served_runs_, dkv);
    be_.release(returned);
    release_saved();
    be_.record(marks_[3]);
    bwd_timed_ = true;
  }

 private:
  struct Wave {
    IndexBuffer key_ids;  // canonical id of each fetched row
    CopyList pack;        // owned rows -> the send buffer
    Act send_ki, send_kv, ki, kv;
  };

  static std::vector<int64_t> canonical_ids(const RowMap& map) {
    std::vector<int64_t> out;
    out.reserve(static_cast<size_t>(map.rows()));
    for (const TokenRange& t : map.ranges()) {
      for (int64_t id = t.begin; id < t.end; ++id) out.push_back(id);
    }
    return out;
  }

  // Starts one all-to-all and counts what leaves and reaches this rank (its own part moves nothing).
  std::unique_ptr<Communicator::Pending> start(const void* send, void* recv, const ExchangeCounts& x, CommType type) {
    const auto es = static_cast<int64_t>(comm_type_size(type));
    for (size_t p = 0; p < x.send_counts.size(); ++p) {
      if (static_cast<int>(p) == comm_.rank()) continue;
      traffic_.bytes_sent += x.send_counts[p] * es;
      traffic_.bytes_received += x.recv_counts[p] * es;
    }
    return comm_.start_all_to_all_v(send, x.send_counts, x.send_displs, recv, x.recv_counts, x.recv_displs, type);
  }

  // Packs the ki (and kv) rows wave i sends and starts their exchanges; one Pending for both.
  std::unique_ptr<Communicator::Pending> start_wave(size_t i, const Act& ki, const Act* kv) {
    const WaveSchedule& ws = s_.waves[i];
    Wave& wave = waves_[i];
    std::vector<std::unique_ptr<Communicator::Pending>> parts;
    auto send = [&](const Act& src, int64_t width, Act& packed, Act& recv) {
      packed = be_.alloc_act(ws.send_total * width);
      be_.pack_rows(src, width, wave.pack, packed, width, 0);
      recv = be_.alloc_act(ws.fetched.rows() * width);
      parts.push_back(start(be_.data(packed), be_.data(recv), exchange_counts(ws.send_rows, ws.recv_rows, width),
                            Backend::act_comm_type));
    };
    send(ki, dims_.di, wave.send_ki, wave.ki);
    if (kv) send(*kv, dims_.dqk, wave.send_kv, wave.kv);
    return std::make_unique<Both>(std::move(parts));
  }
  struct Both : Communicator::Pending {
    explicit Both(std::vector<std::unique_ptr<Communicator::Pending>> p) : parts(std::move(p)) {}
    void wait() override {
      for (auto& p : parts) p->wait();
    }
    std::vector<std::unique_ptr<Communicator::Pending>> parts;
  };

  // The combined buffer and one sparse call over it. kv_in_waves: remote rows are in the waves' buffers;
  // otherwise they are requested from their owners. Either way the owners get the ids (for backward).
  void attend(const Act& q, const Act& kv, const IndexBuffer& ids, bool kv_in_waves, Act& o, Stat& lse) {
    const int cp = comm_.size(), me = comm_.rank();
    const int64_t rows = owned_rows(), width = dims_.dqk;
    layout_ = combine_selected(be_.index_to_host(ids), s_.owned, plan_.plan, me);
    // How many ids each peer asks of this rank, then the ids themselves.
    need_rows_.assign(static_cast<size_t>(cp), 0);
    std::vector<int64_t> need_flat;
    for (int p = 0; p < cp; ++p) {
      const std::vector<int64_t>& n = layout_.need[static_cast<size_t>(p)];
      need_rows_[static_cast<size_t>(p)] = static_cast<int64_t>(n.size());
      need_flat.insert(need_flat.end(), n.begin(), n.end());
    }
    const std::vector<int64_t> ones(static_cast<size_t>(cp), 1);
    IndexBuffer counts_out = be_.index_from_host(need_rows_), counts_in = be_.index_from_host(ones);
    start(be_.index_data(counts_out), be_.index_data(counts_in), exchange_counts(ones, ones, 1), CommType::I64)->wait();
    served_rows_ = be_.index_to_host(counts_in);
    served_total_ = 0;
    for (int64_t n : served_rows_) served_total_ += n;
    IndexBuffer ids_out = be_.index_from_host(need_flat),
                ids_in = be_.index_from_host(std::vector<int64_t>(static_cast<size_t>(served_total_)));
    start(be_.index_data(ids_out), be_.index_data(ids_in), exchange_counts(need_rows_, served_rows_, 1), CommType::I64)
        ->wait();
    const std::vector<int64_t> served = be_.index_to_host(ids_in);
    // The ids each peer sent are sorted: its part of the served rows maps to runs of owned rows.
    std::vector<RowCopy> served_runs;
    int64_t at = 0;
    for (int p = 0; p < cp; ++p) {
      const int64_t n = served_rows_[static_cast<size_t>(p)];
      const std::vector<int64_t> part(served.begin() + at, served.begin() + at + n);
      for (const RowCopy& c : id_runs(part, s_.owned, at, true)) served_runs.push_back(c);
      at += n;
    }
    served_runs_ = be_.upload(served_runs);
    combined_ = be_.alloc_act(layout_.rows * width);
    be_.pack_rows(kv, width, owned_rows_, combined_, width, 0);
    if (kv_in_waves) {
      std::vector<const RowMap*> fetched;
      for (const WaveSchedule& ws : s_.waves) fetched.push_back(&ws.fetched);
      const std::vector<std::vector<RowCopy>> copies = wave_copies(layout_, fetched);
      for (size_t i = 0; i < waves_.size(); ++i) {
        be_.pack_rows(waves_[i].kv, width, be_.upload(copies[i]), combined_, width, 0);
        be_.release(waves_[i].kv);
      }
    } else {
      // Serve the rows peers asked for, and receive ours straight into their sections.
      std::vector<RowCopy> gather;
      for (const RowCopy& c : served_runs) gather.push_back({c.dst_row, c.src_row, c.rows});
      Act serve = be_.alloc_act(served_total_ * width);
      be_.pack_rows(kv, width, be_.upload(gather), serve, width, 0);
      ExchangeCounts x = exchange_counts(served_rows_, need_rows_, width);
      for (size_t p = 0; p < x.recv_displs.size(); ++p) x.recv_displs[p] = layout_.offset[p] * width;
      start(be_.data(serve), be_.data(combined_), x, Backend::act_comm_type)->wait();
      be_.release(serve);
    }
    list_rows_ = be_.index_from_host(layout_.list_rows);
    be_.sparse_forward(dims_, q, rows, combined_, layout_.rows, list_rows_, o, lse);
    q_ = &q;
    o_ = &o;
    lse_ = &lse;
    traffic_.combined_rows = layout_.rows;
    traffic_.remote_rows = layout_.rows - rows;
  }

  // Forgets what a forward kept for its backward.
  void release_saved() {
    be_.release(combined_);
    for (Wave& w : waves_) be_.release(w.kv);
    q_ = o_ = nullptr;
    lse_ = nullptr;
  }

  SparseMlaPlan plan_;
  Row row_;
  SparseMlaDims dims_;
  Communicator& comm_;
  Backend& be_;
  RankSchedule s_;
  IndexBuffer owned_ids_;
  CopyList owned_rows_;  // rows [0, owned) onto rows [0, owned)
  std::vector<Wave> waves_;
  // the last forward, kept for backward
  const Act *q_ = nullptr, *o_ = nullptr;
  const Stat* lse_ = nullptr;
  CombinedLayout layout_;
  Act combined_;
  IndexBuffer list_rows_;
  std::vector<int64_t> need_rows_, served_rows_;  // per peer: rows read from it, rows it read here
  int64_t served_total_ = 0;
  CopyList served_runs_;  // rows of the ids peers read here (packed in peer order) -> owned rows
  SparseMlaTraffic traffic_;
  Mark marks_[4];  // forward begin/end, backward begin/end
  bool fwd_timed_ = false, bwd_timed_ = false;
};

}  // namespace treecp
