// comm/: a narrow communicator (all-to-all with per-peer counts, grouped send/receive, all-reduce,
// all-gather, barrier, agreement) and its MPI, NCCL and thread implementations.
//
// The narrow communicator the runtime needs. Implementations: MPI (CPU ranks, comm/mpi_*.cpp) and
// NCCL (GPU ranks, later). Contract: every rank calls every collective in the same order, with
// zero-sized parts where it has nothing; a rank with no work still participates. Buffers live where
// the backend's tensors live (host memory for MPI, device memory for NCCL). Failures throw
// treecp::Error naming the call; no implementation exits the process.
//
// Deadlines: no call waits for its peers longer than its communicator's deadline. When it passes the
// call throws treecp::Error naming the call and the ranks that did not arrive; the communicator is
// unusable afterwards, and the job should end (cli's RankGroup aborts it). MpiCommunicator waits by
// set_timeout_s() and words the error with deadline_error(); the NCCL and thread communicators take
// their deadline from their options when they are made.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace treecp {

enum class CommType { F32, F64, I64, U8, BF16 };
size_t comm_type_size(CommType t);

struct P2POp {
  enum class Kind { Send, Recv } kind;
  int peer;
  void* buffer;   // const for sends
  int64_t count;  // elements
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // All-to-all with per-peer counts and displacements, in elements of `type`.
  virtual void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                            const std::vector<int64_t>& send_displs, void* recv,
                            const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                            CommType type) = 0;
  // A group of point-to-point sends and receives, all posted then all completed.
  virtual void group_send_recv(const std::vector<P2POp>& ops, CommType type) = 0;
  // In-place sum over ranks.
  virtual void all_reduce_sum(void* data, int64_t count, CommType type) = 0;
  // Every rank contributes `count` elements; recv holds size() * count, in rank order.
  virtual void all_gather(const void* send, void* recv, int64_t count, CommType type) = 0;
  virtual void barrier() = 0;

  // A started all-to-all that completes in wait(): lets a wave's KV travel while the previous stage
  // computes. The buffers must stay alive and untouched until wait() returns. The default runs the
  // exchange at start (correct, without overlap); backends with real asynchrony override it.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void wait() {}
  };
  virtual std::unique_ptr<Pending> start_all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                                      const std::vector<int64_t>& send_displs, void* recv,
                                                      const std::vector<int64_t>& recv_counts,
                                                      const std::vector<int64_t>& recv_displs, CommType type) {
    all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, type);
    return std::make_unique<Pending>();
  }

  // Agreement before any collective that could hang: true on every rank iff `ok` is true on every rank.
  bool all_ok(bool ok);

  // The longest a call waits for its peers, in seconds; must be > 0.
  static constexpr double kDefaultTimeoutS = 300.0;
  void set_timeout_s(double seconds);
  double timeout_s() const { return timeout_s_; }

 protected:
  // The one message of a missed deadline: "<call>: ranks 1, 3 did not arrive within the T s timeout".
  // `missing` empty: every rank arrived, and the call still did not finish.
  Error deadline_error(const std::string& call, const std::vector<int>& missing) const;

 private:
  double timeout_s_ = kDefaultTimeoutS;
};

// A communicator of one rank (no MPI needed): collectives are copies, by memmove unless `copy` is set. A GPU
// backend's caller sets it (its buffers are device memory, which a host memmove cannot touch), e.g. to a copy
// ordered on the backend's stream; it must handle non-overlapping host and device addresses alike.
struct SelfCommOptions {
  std::function<void(void* dst, const void* src, size_t bytes)> copy;
};
std::unique_ptr<Communicator> make_self_communicator(SelfCommOptions options = {});

}  // namespace treecp
