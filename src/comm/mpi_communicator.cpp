#include "comm/mpi_communicator.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "core/error.hpp"

namespace treecp {
namespace {

// Tags of the point-to-point traffic on treecp's private communicator. The parts of a split message
// share the tag: MPI matches one (source, tag) pair's messages in posting order.
constexpr int kAllToAllTag = 1000;
constexpr int kGroupTag = 2000;
// "Which call are you waiting in?" and its answer, both a call number (int64).
constexpr int kQuestionTag = 3000;
constexpr int kAnswerTag = 3001;
// Polling: MPI_Test without pause for the first kSpinS of a wait (short collectives finish there),
// then sleeps growing to kMaxPauseS, which frees the core for oversubscribed ranks.
constexpr double kSpinS = 2e-4;
constexpr double kMaxPauseS = 1e-3;
// How long a rank whose deadline passed waits for the others' answers.
constexpr double kAnswerWaitS = 2.0;

using Clock = std::chrono::steady_clock;
Clock::duration seconds(double s) { return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); }

void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  fail(call, " failed: ", len > 0 ? std::string(text, static_cast<size_t>(len)) : "error code " + std::to_string(rc));
}

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::F32: return MPI_FLOAT;
    case CommType::F64: return MPI_DOUBLE;
    case CommType::I64: return MPI_INT64_T;
    case CommType::U8: return MPI_UINT8_T;
    case CommType::BF16: return MPI_UINT16_T;  // moved as raw 16-bit words; never reduced
  }
  fail("unknown CommType");
}

// Posts the parts of one message of `count` elements (at most `limit` elements per part).
void post_parts(std::vector<MPI_Request>& reqs, std::vector<int>& peers, bool is_send, void* buf, int64_t count,
                int peer, int tag, MPI_Datatype dt, size_t elem_size, int64_t limit, MPI_Comm comm) {
  for (int64_t off = 0; off < count; off += limit) {
    const int n = static_cast<int>(std::min(limit, count - off));
    char* p = static_cast<char*>(buf) + static_cast<size_t>(off) * elem_size;
    MPI_Request r;
    if (is_send) {
      check(MPI_Isend(p, n, dt, peer, tag, comm, &r), "MPI_Isend");
    } else {
      check(MPI_Irecv(p, n, dt, peer, tag, comm, &r), "MPI_Irecv");
    }
    reqs.push_back(r);
    peers.push_back(peer);
  }
}

}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (initialized) return;
  int provided = 0;
  check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  owns_ = true;
  check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
}

MpiSession::~MpiSession() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();  // a destructor cannot throw; a failing finalize has nothing left to report to
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, int64_t max_message_elements)
    : max_message_elements_(max_message_elements) {
  require(max_message_elements >= 1 && max_message_elements <= kMaxMessageElements,
          "MpiCommunicator: max_message_elements must be in [1, INT_MAX], got ", max_message_elements);
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  require(initialized, "MpiCommunicator: MPI is not initialised (create an MpiSession first)");
  check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ == MPI_COMM_NULL || finalized) return;
  // Answers still in flight read answers_: give them a moment, then let MPI finish them alone.
  const Clock::time_point until = Clock::now() + seconds(0.1);
  int done = answer_reqs_.empty();
  while (!done && Clock::now() < until) {
    MPI_Testall(static_cast<int>(answer_reqs_.size()), answer_reqs_.data(), &done, MPI_STATUSES_IGNORE);
  }
  for (MPI_Request& r : answer_reqs_) {
    if (!done && r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  }
  MPI_Comm_free(&comm_);  // a destructor cannot throw; a failing free has nothing left to report to
}

namespace {

class MpiPending final : public Communicator::Pending {
 public:
  MpiPending(MpiCommunicator& comm, std::vector<MPI_Request> reqs, std::vector<int> peers)
      : comm_(comm), reqs_(std::move(reqs)), peers_(std::move(peers)) {}
  ~MpiPending() override {
    // An abandoned exchange must still complete (its buffers are the caller's), but not forever: after
    // the deadline the job is ending anyway, and a destructor cannot throw.
    if (reqs_.empty()) return;
    try {
      comm_.wait(reqs_, peers_, "all_to_all_v");
    } catch (const Error&) {
    }
  }
  void wait() override { comm_.wait(reqs_, peers_, "all_to_all_v"); }

 private:
  MpiCommunicator& comm_;
  std::vector<MPI_Request> reqs_;
  std::vector<int> peers_;
};

}  // namespace

// Point-to-point rather than MPI_Alltoallv: MPI's counts and displacements are int, and whether a
// call needs splitting is known per pair (both ends know the pair's count) but not globally, so
// one rank choosing MPI_Alltoallv while another chose messages would deadlock.
std::unique_ptr<Communicator::Pending> MpiCommunicator::start_all_to_all_v(
    const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs, void* recv,
    const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs, CommType type) {
  ++calls_;
  const size_t n = static_cast<size_t>(size_);
  require(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n && recv_displs.size() == n,
          "all_to_all_v: one count and displacement per rank expected (", size_, " ranks), got send ",
          send_counts.size(), "/", send_displs.size(), ", recv ", recv_counts.size(), "/", recv_displs.size());
  for (size_t p = 0; p < n; ++p) {
    require(send_counts[p] >= 0 && recv_counts[p] >= 0 && send_displs[p] >= 0 && recv_displs[p] >= 0,
            "all_to_all_v: counts and displacements must be >= 0 (peer ", p, ")");
  }
  require(send_counts[rank_] == recv_counts[rank_], "all_to_all_v: self send count ", send_counts[rank_],
          " != self receive count ", recv_counts[rank_]);
  const MPI_Datatype dt = mpi_type(type);
  const size_t es = comm_type_size(type);
  std::vector<MPI_Request> reqs;
  std::vector<int> peers;
  try {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || recv_counts[p] == 0) continue;
      post_parts(reqs, peers, false, static_cast<char*>(recv) + recv_displs[p] * es, recv_counts[p], p, kAllToAllTag,
                 dt, es, max_message_elements_, comm_);
    }
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || send_counts[p] == 0) continue;
      post_parts(reqs, peers, true, const_cast<char*>(static_cast<const char*>(send)) + send_displs[p] * es,
                 send_counts[p], p, kAllToAllTag, dt, es, max_message_elements_, comm_);
    }
  } catch (...) {
    MpiPending abandon(*this, std::move(reqs), std::move(peers));  // completes what was posted
    throw;
  }
  if (send_counts[rank_] > 0) {
    std::memmove(static_cast<char*>(recv) + recv_displs[rank_] * es,
                 static_cast<const char*>(send) + send_displs[rank_] * es, static_cast<size_t>(send_counts[rank_]) * es);
  }
  return std::make_unique<MpiPending>(*this, std::move(reqs), std::move(peers));
}

void MpiCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_counts,
                                   const std::vector<int64_t>& send_displs, void* recv,
                                   const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                                   CommType type) {
  start_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, type)->wait();
}

void MpiCommunicator::group_send_recv(const std::vector<P2POp>& ops, CommType type) {
  ++calls_;
  for (const auto& op : ops) {
    require(op.peer >= 0 && op.peer < size_, "group_send_recv: peer ", op.peer, " out of range for ", size_, " ranks");
    require(op.count >= 0, "group_send_recv: count must be >= 0, got ", op.count);
  }
  const MPI_Datatype dt = mpi_type(type);
  const size_t es = comm_type_size(type);
  // One tag for everything: MPI matches messages of one (source, tag) pair in posting order, so the
  // k-th send to a peer (part by part) meets that peer's k-th receive from this rank.
  std::vector<MPI_Request> reqs;
  std::vector<int> peers;
  for (const auto& op : ops) {
    post_parts(reqs, peers, op.kind == P2POp::Kind::Send, op.buffer, op.count, op.peer, kGroupTag, dt, es,
               max_message_elements_, comm_);
  }
  wait(reqs, peers, "group_send_recv");
}

void MpiCommunicator::all_reduce_sum(void* data, int64_t count, CommType type) {
  ++calls_;
  require(count >= 0, "all_reduce_sum: count must be >= 0, got ", count);
  require(type != CommType::BF16, "all_reduce_sum: BF16 sums are not supported by the MPI backend");
  const MPI_Datatype dt = mpi_type(type);
  const size_t es = comm_type_size(type);
  // Every rank has the same count, so every rank makes the same calls.
  std::vector<MPI_Request> reqs(1);
  for (int64_t off = 0; off < count; off += max_message_elements_) {
    const int n = static_cast<int>(std::min(max_message_elements_, count - off));
    check(MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(data) + static_cast<size_t>(off) * es, n, dt, MPI_SUM, comm_,
                         reqs.data()),
          "MPI_Iallreduce");
    wait(reqs, {}, "MPI_Allreduce");
    reqs.resize(1);
  }
}

void MpiCommunicator::all_gather(const void* send, void* recv, int64_t count, CommType type) {
  ++calls_;
  require(count >= 0, "all_gather: count must be >= 0, got ", count);
  const MPI_Datatype dt = mpi_type(type);
  const size_t es = comm_type_size(type);
  if (count == 0) return;
  std::vector<MPI_Request> reqs(1);
  if (count <= max_message_elements_ / std::max(1, size_)) {
    if (send == static_cast<const char*>(recv) + static_cast<size_t>(rank_ * count) * es) {
      check(MPI_Iallgather(MPI_IN_PLACE, 0, dt, recv, static_cast<int>(count), dt, comm_, reqs.data()),
            "MPI_Iallgather");
    } else {
      check(MPI_Iallgather(send, static_cast<int>(count), dt, recv, static_cast<int>(count), dt, comm_, reqs.data()),
            "MPI_Iallgather");
    }
    wait(reqs, {}, "MPI_Allgather");
    return;
  }
  // Large: gather piece by piece through a staging buffer, then place each rank's piece.
  const int64_t piece = std::max<int64_t>(1, max_message_elements_ / std::max(1, size_));
  std::vector<char> own(static_cast<size_t>(count) * es);
  std::memcpy(own.data(), send, own.size());
  std::vector<char> stage(static_cast<size_t>(std::min(piece, count) * size_) * es);
  for (int64_t off = 0; off < count; off += piece) {
    const int64_t n = std::min(piece, count - off);
    reqs.resize(1);
    check(MPI_Iallgather(own.data() + static_cast<size_t>(off) * es, static_cast<int>(n), dt, stage.data(),
                         static_cast<int>(n), dt, comm_, reqs.data()),
          "MPI_Iallgather");
    wait(reqs, {}, "MPI_Allgather");
    for (int r = 0; r < size_; ++r) {
      std::memcpy(static_cast<char*>(recv) + static_cast<size_t>(r * count + off) * es,
                  stage.data() + static_cast<size_t>(r * n) * es, static_cast<size_t>(n) * es);
    }
  }
}

void MpiCommunicator::barrier() {
  ++calls_;
  std::vector<MPI_Request> reqs(1);
  check(MPI_Ibarrier(comm_, reqs.data()), "MPI_Ibarrier");
  wait(reqs, {}, "MPI_Barrier");
}

void MpiCommunicator::wait(std::vector<MPI_Request>& reqs, const std::vector<int>& peers, const std::string& call) {
  const Clock::time_point start = Clock::now(), deadline = start + seconds(timeout_s());
  Clock::duration pause{};
  for (;;) {
    int done = 0;
    check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) {
      reqs.clear();
      return;
    }
    answer_questions();
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      std::vector<int> missing;
      if (peers.empty()) {
        missing = missing_ranks();
      } else {
        for (size_t i = 0; i < reqs.size(); ++i) {
          int finished = 0;
          check(MPI_Test(&reqs[i], &finished, MPI_STATUS_IGNORE), "MPI_Test");
          if (!finished) missing.push_back(peers[i]);
        }
        std::sort(missing.begin(), missing.end());
        missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
      }
      // The outstanding requests are left behind: their buffers are the caller's, and the job ends.
      reqs.clear();
      throw deadline_error(call, missing);
    }
    if (now - start > seconds(kSpinS)) {
      std::this_thread::sleep_for(pause);
      pause = std::min(2 * pause + seconds(1e-5), seconds(kMaxPauseS));
    }
  }
}

void MpiCommunicator::answer_questions() {
  for (;;) {
    int asked = 0;
    MPI_Status status;
    check(MPI_Iprobe(MPI_ANY_SOURCE, kQuestionTag, comm_, &asked, &status), "MPI_Iprobe");
    if (!asked) break;
    int64_t theirs = 0;
    check(MPI_Recv(&theirs, 1, MPI_INT64_T, status.MPI_SOURCE, kQuestionTag, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
    answers_.push_back(calls_);
    answer_reqs_.emplace_back();
    check(MPI_Isend(&answers_.back(), 1, MPI_INT64_T, status.MPI_SOURCE, kAnswerTag, comm_, &answer_reqs_.back()),
          "MPI_Isend");
  }
  if (answer_reqs_.empty()) return;
  int done = 0;
  check(MPI_Testall(static_cast<int>(answer_reqs_.size()), answer_reqs_.data(), &done, MPI_STATUSES_IGNORE),
        "MPI_Testall");
  if (done) {
    answer_reqs_.clear();
    answers_.clear();
  }
}

std::vector<int> MpiCommunicator::missing_ranks() {
  question_ = calls_;
  std::vector<MPI_Request> asks;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    asks.emplace_back();
    check(MPI_Isend(&question_, 1, MPI_INT64_T, p, kQuestionTag, comm_, &asks.back()), "MPI_Isend");
  }
  std::vector<char> here(static_cast<size_t>(size_), 0);
  here[static_cast<size_t>(rank_)] = 1;
  int answered = 1;
  const Clock::time_point until = Clock::now() + seconds(std::min(kAnswerWaitS, timeout_s()));
  while (answered < size_ && Clock::now() < until) {
    answer_questions();  // the others may be asking too
    int got = 0;
    MPI_Status status;
    check(MPI_Iprobe(MPI_ANY_SOURCE, kAnswerTag, comm_, &got, &status), "MPI_Iprobe");
    if (!got) {
      std::this_thread::sleep_for(seconds(kMaxPauseS));
      continue;
    }
    int64_t call = 0;
    check(MPI_Recv(&call, 1, MPI_INT64_T, status.MPI_SOURCE, kAnswerTag, comm_, MPI_STATUS_IGNORE), "MPI_Recv");
    // A rank waiting in another call has not arrived at this one.
    if (call == calls_ && !here[static_cast<size_t>(status.MPI_SOURCE)]) {
      here[static_cast<size_t>(status.MPI_SOURCE)] = 1;
      ++answered;
    }
  }
  // Questions to ranks that never receive them stay outstanding: free them, the job is ending.
  for (MPI_Request& r : asks) {
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  }
  std::vector<int> missing;
  for (int p = 0; p < size_; ++p) {
    if (!here[static_cast<size_t>(p)]) missing.push_back(p);
  }
  return missing;
}

std::unique_ptr<Communicator> make_world_communicator() {
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) return make_self_communicator();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

}  // namespace treecp
