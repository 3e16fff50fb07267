// comm/: a narrow communicator (all-to-all with per-peer counts, grouped send/receive, all-reduce,
// all-gather, barrier, agreement) and its MPI, NCCL and thread implementations.
//
// A Communicator that forwards every call to another and counts the bytes that the all-to-alls and
// point-to-point groups move between different ranks (a rank's part to itself is a local copy and
// is not counted). Reductions, gathers and barriers are forwarded uncounted. Used to measure what a
// protocol moves against what its planner predicts.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"

namespace treecp {

class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                    void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                    CommType type) override {
    ++exchanges_;
    const int64_t es = static_cast<int64_t>(comm_type_size(type));
    for (size_t p = 0; p < send_counts.size(); ++p) {
      if (static_cast<int>(p) == rank()) continue;
      bytes_sent_ += send_counts[p] * es;
      bytes_received_ += p < recv_counts.size() ? recv_counts[p] * es : 0;
    }
    inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, type);
  }
  void group_send_recv(const std::vector<P2POp>& ops, CommType type) override {
    ++exchanges_;
    const int64_t es = static_cast<int64_t>(comm_type_size(type));
    for (const P2POp& op : ops) {
      if (op.peer == rank()) continue;
      (op.kind == P2POp::Kind::Send ? bytes_sent_ : bytes_received_) += op.count * es;
    }
    inner_.group_send_recv(ops, type);
  }
  void all_reduce_sum(void* data, int64_t count, CommType type) override { inner_.all_reduce_sum(data, count, type); }
  void all_gather(const void* send, void* recv, int64_t count, CommType type) override {
    inner_.all_gather(send, recv, count, type);
  }
  void barrier() override { inner_.barrier(); }

  int64_t bytes_sent() const { return bytes_sent_; }
  int64_t bytes_received() const { return bytes_received_; }
  // All-to-alls and point-to-point groups called, whatever they moved.
  int64_t exchanges() const { return exchanges_; }

 private:
  Communicator& inner_;
  int64_t bytes_sent_ = 0, bytes_received_ = 0, exchanges_ = 0;
};

}  // namespace treecp
