// comm/: a narrow communicator (all-to-all with per-peer counts, grouped send/receive, all-reduce,
// all-gather, barrier, agreement) and its MPI, NCCL and thread implementations.
//
// The MPI backend of Communicator (CPU ranks, host buffers). Compiled only when MPI is found
// (TREECP_HAVE_MPI). Every MPI call is checked: the communicator runs with MPI_ERRORS_RETURN and a
// failing call throws treecp::Error naming the call and MPI's error string.
//
// Element counts are int64: messages above max_message_elements() are split into several MPI
// messages (both sides of a pair know the pair's count, so they split it the same way).
//
// Deadlines: every call posts non-blocking operations and polls them until timeout_s() has passed.
// Then the ranks that did not arrive are named: for point-to-point traffic, the peers whose messages
// are still outstanding; for a collective, the ranks that do not answer "which call are you waiting
// in?" with this one (every waiting rank answers that question while it polls).
#pragma once

#include <mpi.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

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

  // Completes `reqs` (empty on return) or throws deadline_error() naming `call`. peers[i] is the rank
  // request i exchanges with; empty peers: the requests are one collective. Public for MpiPending.
  void wait(std::vector<MPI_Request>& reqs, const std::vector<int>& peers, const std::string& call);

 private:
  void answer_questions();        // tells every rank that asks which call this one waits in
  std::vector<int> missing_ranks();  // asks every rank; those not waiting in this call are missing

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int64_t max_message_elements_;
  int64_t calls_ = 0;  // calls started, the same sequence on every rank (the contract)
  int64_t question_ = 0;
  std::deque<int64_t> answers_;  // send buffers of the answers, alive until they complete
  std::vector<MPI_Request> answer_reqs_;
};

// A communicator over MPI_COMM_WORLD when MPI is initialised, else the self communicator.
std::unique_ptr<Communicator> make_world_communicator();

}  // namespace treecp
