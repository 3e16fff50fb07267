// The main of every MPI test executable (tests/common): MPI initialised around the whole run, one test
// seed for all ranks (rank 0's, broadcast, so that every rank draws the same inputs), every rank runs
// every test in the same order (so collectives stay in step), rank 0 prints the usual report, the
// other ranks print only their failures, and every rank exits non-zero when any rank failed.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "comm/mpi_communicator.hpp"
#include "common/common.hpp"

namespace treecp::testing {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

// `body()` runs the tests (RUN_ALL_TESTS()) and returns its result; it may set up rank-wide state first.
template <class Body>
int run_on_all_ranks(int argc, char** argv, Body body) {
  MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  unsigned long long seed = rank == 0 ? base_seed() : 0;
  MPI_Bcast(&seed, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  if (rank != 0) set_base_seed(seed, /*announce=*/false);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int failed = body() != 0 ? 1 : 0, any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any && !failed) std::fprintf(stderr, "rank %d: passed, but another rank failed\n", rank);
  return any;
}

}  // namespace treecp::testing
