// gather_spans under mpirun with 1-4 ranks: every rank's spans arrive on the root in rank order, exact,
// ranks with no spans included; the other ranks get nothing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/mpi_communicator.hpp"
#include "core/trace.hpp"
#include "common/mpi_main.hpp"
#include "runtime/span_gather.hpp"

namespace treecp {
namespace {

// Rank r records r spans (rank 0 none), with values every rank can predict.
std::vector<Span> spans_of(int r) {
  std::vector<Span> out;
  for (int i = 0; i < r; ++i) {
    out.push_back({"rank " + std::to_string(r) + " \"span\" " + std::to_string(i), i % 2 ? "stage" : "transfer", -5,
                   i % 2, r + i / 3.0, r + i / 3.0 + 1e-7 * (i + 1)});
  }
  return out;
}

TEST(MpiTrace, GatherBringsEveryRanksSpansToTheRoot) {
  MpiCommunicator comm;
  const int n = comm.size();
  for (int root = 0; root < n; ++root) {
    const std::vector<Span> got = gather_spans(comm, spans_of(comm.rank()), root);
    if (comm.rank() != root) {
      EXPECT_TRUE(got.empty());
      continue;
    }
    std::vector<Span> want;
    for (int r = 0; r < n; ++r) {
      for (Span s : spans_of(r)) {
        s.rank = r;
        want.push_back(s);
      }
    }
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].name, want[i].name);
      EXPECT_EQ(got[i].category, want[i].category);
      EXPECT_EQ(got[i].rank, want[i].rank);
      EXPECT_EQ(got[i].track, want[i].track);
      EXPECT_EQ(got[i].begin_ms, want[i].begin_ms);
      EXPECT_EQ(got[i].end_ms, want[i].end_ms);
    }
  }
}

}  // namespace
}  // namespace treecp

int main(int argc, char** argv) {
  return treecp::testing::run_on_all_ranks(argc, argv, [] { return RUN_ALL_TESTS(); });
}
