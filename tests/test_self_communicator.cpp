// The one-rank communicator (comm/communicator.hpp, make_self_communicator): its collectives deliver every
// part, and with SelfCommOptions::copy every byte they move goes through that function and nothing else (a
// GPU caller's buffers are device memory, which a host memmove would crash on). A GDN run at one rank whose
// forced chained plan sends states to itself gives the same bits either way.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "comm/communicator.hpp"
#include "plan/gdn_plan.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/gdn_cp.hpp"
#include "tree/row.hpp"

#include "common/common.hpp"
#include "common/gdn.hpp"

namespace treecp {
namespace {

struct Move {
  void* dst;
  const void* src;
  size_t bytes;
};

// A copy function that records each move and performs it only when `perform`.
SelfCommOptions recording(std::vector<Move>& moves, bool perform) {
  return {[&moves, perform](void* dst, const void* src, size_t bytes) {
    moves.push_back({dst, src, bytes});
    if (perform) std::memcpy(dst, src, bytes);
  }};
}

std::vector<int64_t> iota(int64_t n, int64_t first) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(SelfCommunicator, CollectivesDeliverEveryPartWithAndWithoutACopyFunction) {
  std::vector<Move> moves;
  for (bool with_copy : {false, true}) {
    SCOPED_TRACE(with_copy ? "copy function" : "memmove");
    auto comm = with_copy ? make_self_communicator(recording(moves, true)) : make_self_communicator();
    const std::vector<int64_t> send = iota(10, 100);
    std::vector<int64_t> recv(12, -1);
    comm->all_to_all_v(send.data(), {7}, {2}, recv.data(), {7}, {4}, CommType::I64);
    for (int i = 0; i < 12; ++i) EXPECT_EQ(recv[i], i >= 4 && i < 11 ? 102 + (i - 4) : -1) << i;

    std::vector<int64_t> a = iota(3, 7), b = iota(5, 20), ra(3, 0), rb(5, 0);
    comm->group_send_recv({{P2POp::Kind::Send, 0, a.data(), 3},
                           {P2POp::Kind::Send, 0, b.data(), 5},
                           {P2POp::Kind::Recv, 0, ra.data(), 3},
                           {P2POp::Kind::Recv, 0, rb.data(), 5}},
                          CommType::I64);
    EXPECT_EQ(ra, a);
    EXPECT_EQ(rb, b);

    std::vector<int64_t> gathered(4, 0);
    comm->all_gather(send.data(), gathered.data(), 4, CommType::I64);
    EXPECT_EQ(gathered, iota(4, 100));
  }
  // The copy function saw exactly the three collectives' parts, in bytes, from and to the right places.
  ASSERT_EQ(moves.size(), 4u);
  EXPECT_EQ(moves[0].bytes, 7 * sizeof(int64_t));
  EXPECT_EQ(moves[1].bytes, 3 * sizeof(int64_t));
  EXPECT_EQ(moves[2].bytes, 5 * sizeof(int64_t));
  EXPECT_EQ(moves[3].bytes, 4 * sizeof(int64_t));
}

TEST(SelfCommunicator, WithACopyFunctionNothingElseMovesAByte) {
  std::vector<Move> moves;
  auto comm = make_self_communicator(recording(moves, false));
  const std::vector<float> send(6, 1.5f);
  std::vector<float> recv(6, 0.0f), gathered(6, 0.0f), ra(6, 0.0f);
  comm->all_to_all_v(send.data(), {6}, {0}, recv.data(), {6}, {0}, CommType::F32);
  comm->group_send_recv({{P2POp::Kind::Send, 0, const_cast<float*>(send.data()), 6}, {P2POp::Kind::Recv, 0, ra.data(), 6}},
                        CommType::F32);
  comm->all_gather(send.data(), gathered.data(), 6, CommType::F32);
  ASSERT_EQ(moves.size(), 3u);
  for (const Move& m : moves) {
    EXPECT_EQ(m.src, send.data());
    EXPECT_EQ(m.bytes, 6 * sizeof(float));
  }
  EXPECT_EQ(moves[0].dst, recv.data());
  EXPECT_EQ(moves[1].dst, ra.data());
  EXPECT_EQ(moves[2].dst, gathered.data());
  // The function moved nothing, so nothing arrived: no memmove behind its back.
  for (const auto* v : {&recv, &ra, &gathered})
    for (float x : *v) EXPECT_EQ(x, 0.0f);
  // Empty parts are not handed to it.
  comm->all_to_all_v(send.data(), {0}, {0}, recv.data(), {0}, {0}, CommType::F32);
  comm->all_gather(send.data(), gathered.data(), 0, CommType::F32);
  EXPECT_EQ(moves.size(), 3u);
}

TEST(SelfCommunicator, ChainedGdnAtOneRankGivesTheSameBitsThroughACopyFunction) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(23);
  const Row row = testing::random_tree(rng, {.segments = 7, .max_len = 30});
  const testing::GdnData d = testing::random_gdn_data(row.tokens(), 2, 4, 3, GdnGate::PerChannel, rng);
  // Every segment chained: its shard summaries scan over the (one) rank, states sent to itself.
  const GdnPlan plan = make_gdn_plan(row, 1, std::vector<uint8_t>(static_cast<size_t>(row.num_segments()), 1));
  const GdnShape shape = d.shape(0.7, 8);
  const auto in = testing::gdn_buffers<double>(d, gdn_rank_ranges(row, plan, 0));
  auto plain = make_self_communicator();
  std::vector<Move> moves;
  auto copying = make_self_communicator(recording(moves, true));
  const auto a = testing::run_gdn_cp(*plain, row, plan, shape, in);
  const auto b = testing::run_gdn_cp(*copying, row, plan, shape, in);
  EXPECT_GT(moves.size(), 0u) << "the chained plan should exchange states with itself";
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.dg, b.dg);
  EXPECT_EQ(a.dbeta, b.dbeta);
  // And the run is the tree's: against the double reference.
  const auto ref = testing::gdn_tree_reference(row, d, 0.7);
  EXPECT_LT(testing::max_error(b.y, ref.y), 1e-11 * (1 + testing::max_abs(ref.y)));
}

}  // namespace
}  // namespace treecp
