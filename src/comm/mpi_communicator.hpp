// comm/: a narrow communicator (all-to-all with per-peer counts, grouped send/receive, all-reduce,
// all-gather, barrier, agreement) and its MPI, NCCL and thread implementations.
//
// The MPI backend of Communicator (CPU ranks, host buffers). Compiled only when MPI is found
// (TREECP_HAVE_MPI). Every MPI call is checked: the communicator runs with MPI_ERRORS_RETURN and a
// failing call throws treecp::Error naming the call and MPI's error string.
//
// Element counts are int64: messages above max_message_elements() are split into several MPI
// messages (both sides of a pair know the pair's count, so they split it the same way).
#pragma once

#include <mpi.h>

#include <memory>

#include "comm/communicator.hpp"

namespace treecp {

// Initialises MPI on construction if nobody has (MPI_THREAD_FUNNELED) and finalises it on
// destruction if it did. Safe to nest and to use when MPI was initialised by someone else.
class MpiSession {
 public:
  MpiSession(int* argc = nullptr, char*** argv = nullptr);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  bool owns_ = false;
};

class MpiCommunicator final : public Communicator {
 public:
  // Wraps a duplicate of `comm` (MPI_COMM_WORLD by default), so that treecp's messages never match
  // the caller's. MPI must be initialised. `max_message_elements` bounds one MPI message (tests
  // lower it to exercise the splitting); it must be in [1, INT_MAX].
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD, int64_t max_message_elements = kMaxMessageElements);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                    void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                    CommType type) override;
  // Posts every message and returns; wait() completes them (the self part is copied at start).
  std::unique_ptr<Pending> start_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                              const std::vector<int64_t>& send_displs, void* recv,
                                              const std::vector<int64_t>& recv_counts,
                                              const std::vector<int64_t>& recv_displs, CommType type) override;
  void group_send_recv(const std::vector<P2POp>& ops, CommType type) override;
  void all_reduce_sum(void* data, int64_t count, CommType type) override;
  void all_gather(const void* send, void* recv, int64_t count, CommType type) override;
  void barrier() override;

  MPI_Comm comm() const { return comm_; }
  int64_t max_message_elements() const { return max_message_elements_; }

  // INT_MAX elements, the most one MPI count can say.
  static constexpr int64_t kMaxMessageElements = 2147483647;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int64_t max_message_elements_;
};

// A communicator over MPI_COMM_WORLD when MPI is initialised, else the self communicator.
std::unique_ptr<Communicator> make_world_communicator();

}  // namespace treecp
