// MpiCommunicator under mpirun with 1-6 ranks: every collective, zero-count peers, split messages,
// agreement, and errors that name the call.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <numeric>
#include <vector>

#include "comm/mpi_communicator.hpp"
#include "common/mpi_main.hpp"
#include "core/error.hpp"

namespace treecp {
namespace {

// Element (from src, to dst, index i): a value every rank can predict.
double pattern(int src, int dst, int64_t i) { return 1000.0 * src + 100.0 * dst + static_cast<double>(i) * 0.5; }

// Counts differ per pair and direction, and some pairs send nothing.
int64_t pair_count(int src, int dst) { return (src + 2 * dst) % 3 == 0 ? 0 : (src + 2 * dst) % 3 + src; }

void run_all_to_all(MpiCommunicator& comm, bool started = false) {
  const int n = comm.size(), r = comm.rank();
  std::vector<int64_t> sc(n), sd(n), rc(n), rd(n);
  int64_t stot = 0, rtot = 0;
  for (int p = 0; p < n; ++p) {
    sc[p] = pair_count(r, p);
    sd[p] = stot + 1;  // a gap of one element before each part: displacements are honoured
    stot += sc[p] + 1;
    rc[p] = pair_count(p, r);
    rd[p] = rtot + 2;
    rtot += rc[p] + 2;
  }
  std::vector<double> send(static_cast<size_t>(stot), -1.0), recv(static_cast<size_t>(rtot), -7.0);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < sc[p]; ++i) send[sd[p] + i] = pattern(r, p, i);
  if (started) {
    auto pending = comm.start_all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd, CommType::F64);
    pending->wait();
  } else {
    comm.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd, CommType::F64);
  }
  for (int p = 0; p < n; ++p) {
    for (int64_t i = 0; i < rc[p]; ++i) ASSERT_EQ(recv[rd[p] + i], pattern(p, r, i)) << "from " << p << " i " << i;
    ASSERT_EQ(recv[rd[p] - 1], -7.0);
  }
}

TEST(MpiComm, AllToAllVWithZeroCountsAndDisplacements) {
  MpiCommunicator comm;
  run_all_to_all(comm);
}

TEST(MpiComm, AllToAllVSplitsLargeMessages) {
  MpiCommunicator comm(MPI_COMM_WORLD, /*max_message_elements=*/2);
  run_all_to_all(comm);
}

TEST(MpiComm, StartedAllToAllVCompletesInWait) {
  MpiCommunicator comm(MPI_COMM_WORLD, 3);
  run_all_to_all(comm, /*started=*/true);
}

TEST(MpiComm, AllToAllVRefusesWrongSizes) {
  MpiCommunicator comm;
  std::vector<int64_t> one(1, 0), many(static_cast<size_t>(comm.size() + 1), 0);
  const auto& bad = comm.size() == 1 ? many : one;
  EXPECT_THROW(comm.all_to_all_v(nullptr, bad, bad, nullptr, bad, bad, CommType::F32), Error);
}

TEST(MpiComm, GroupSendRecvRing) {
  for (int64_t limit : {int64_t{3}, MpiCommunicator::kMaxMessageElements}) {
    MpiCommunicator comm(MPI_COMM_WORLD, limit);
    const int n = comm.size(), r = comm.rank();
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    // Two messages to the same peer keep their order.
    std::vector<float> a(7), b(2), ra(7, 0.f), rb(2, 0.f);
    for (int i = 0; i < 7; ++i) a[i] = static_cast<float>(r * 10 + i);
    for (int i = 0; i < 2; ++i) b[i] = static_cast<float>(-r - i);
    comm.group_send_recv({{P2POp::Kind::Send, next, a.data(), 7},
                          {P2POp::Kind::Send, next, b.data(), 2},
                          {P2POp::Kind::Recv, prev, ra.data(), 7},
                          {P2POp::Kind::Recv, prev, rb.data(), 2}},
                         CommType::F32);
    for (int i = 0; i < 7; ++i) EXPECT_EQ(ra[i], static_cast<float>(prev * 10 + i));
    for (int i = 0; i < 2; ++i) EXPECT_EQ(rb[i], static_cast<float>(-prev - i));
  }
}

TEST(MpiComm, AllReduceAndAllGather) {
  for (int64_t limit : {int64_t{2}, MpiCommunicator::kMaxMessageElements}) {
    MpiCommunicator comm(MPI_COMM_WORLD, limit);
    const int n = comm.size(), r = comm.rank();
    std::vector<int64_t> v(5);
    for (int i = 0; i < 5; ++i) v[i] = r * 3 + i;
    comm.all_reduce_sum(v.data(), 5, CommType::I64);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(v[i], 3 * (n * (n - 1) / 2) + n * i);
    std::vector<double> mine(5), all(static_cast<size_t>(5 * n), 0.0);
    for (int i = 0; i < 5; ++i) mine[i] = pattern(r, 0, i);
    comm.all_gather(mine.data(), all.data(), 5, CommType::F64);
    for (int p = 0; p < n; ++p)
      for (int i = 0; i < 5; ++i) EXPECT_EQ(all[p * 5 + i], pattern(p, 0, i));
    // In place: the own part already sits in recv.
    std::vector<float> inplace(static_cast<size_t>(3 * n), 0.f);
    for (int i = 0; i < 3; ++i) inplace[r * 3 + i] = static_cast<float>(r + i);
    comm.all_gather(inplace.data() + r * 3, inplace.data(), 3, CommType::F32);
    for (int p = 0; p < n; ++p)
      for (int i = 0; i < 3; ++i) EXPECT_EQ(inplace[p * 3 + i], static_cast<float>(p + i));
  }
}

TEST(MpiComm, AllOkAgrees) {
  MpiCommunicator comm;
  EXPECT_TRUE(comm.all_ok(true));
  EXPECT_FALSE(comm.all_ok(comm.rank() != comm.size() - 1));
  comm.barrier();
}

TEST(MpiComm, FailuresNameTheCall) {
  MpiCommunicator comm;
  std::vector<float> buf(4);
  // A peer outside the communicator and a BF16 sum are refused by name; MPI's own failure (an invalid
  // communicator) comes back as an Error naming the MPI call instead of aborting the job.
  EXPECT_THROW(comm.group_send_recv({{P2POp::Kind::Send, comm.size(), buf.data(), 1}}, CommType::F32), Error);
  try {
    comm.all_reduce_sum(buf.data(), 4, CommType::BF16);
    FAIL() << "BF16 sum accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_reduce_sum"), std::string::npos);
  }
  try {
    MpiCommunicator bad(MPI_COMM_NULL);
    FAIL() << "MPI_COMM_NULL accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MPI_"), std::string::npos) << e.what();
  }
}

// The last rank does not come to a call: every other rank's call ends at the deadline with one error
// naming the call and that rank (found from outstanding messages for point-to-point traffic, and by
// asking the waiting ranks for a collective).
TEST(MpiComm, DeadlineNamesTheCallAndTheRankThatDidNotArrive) {
  int world = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (world == 1) GTEST_SKIP() << "needs a rank that can be late";
  const int late = world - 1;
  const double timeout_s = 0.3;
  // Buffers of abandoned calls may still be written by the ranks that came: they live to the end.
  static std::vector<std::vector<double>> kept;
  const std::vector<std::string> calls = {"MPI_Barrier", "MPI_Allreduce", "MPI_Allgather", "all_to_all_v"};
  for (const std::string& call : calls) {
    MpiCommunicator comm;
    comm.set_timeout_s(timeout_s);
    comm.barrier();
    if (me == late) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // past the others' deadline and answer wait
    } else {
      kept.emplace_back(static_cast<size_t>(4 * world), 1.0);
      double* buf = kept.back().data();
      const auto t0 = std::chrono::steady_clock::now();
      std::string message;
      try {
        if (call == "MPI_Barrier") comm.barrier();
        if (call == "MPI_Allreduce") comm.all_reduce_sum(buf, 4, CommType::F64);
        if (call == "MPI_Allgather") comm.all_gather(buf, buf + 4, 1, CommType::F64);
        if (call == "all_to_all_v") {
          std::vector<int64_t> counts(static_cast<size_t>(world), 1), displs(static_cast<size_t>(world));
          for (int p = 0; p < world; ++p) displs[static_cast<size_t>(p)] = p;
          comm.all_to_all_v(buf, counts, displs, buf + world, counts, displs, CommType::F64);
        }
      } catch (const Error& e) {
        message = e.what();
      }
      const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_EQ(message, call + ": rank " + std::to_string(late) + " did not arrive within the 0.3 s timeout");
      EXPECT_GE(waited_s, timeout_s);
      EXPECT_LT(waited_s, 2.0);  // deadline and answer wait (0.6 s), with room for a loaded machine
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MpiCommunicator comm;
  EXPECT_THROW(comm.set_timeout_s(0), Error);
  EXPECT_EQ(comm.timeout_s(), Communicator::kDefaultTimeoutS);
}

}  // namespace
}  // namespace treecp

// Runs the suite on every rank; the exit status is failure on every rank if any rank failed.
int main(int argc, char** argv) {
  return treecp::testing::run_on_all_ranks(argc, argv, [] { return RUN_ALL_TESTS(); });
}
