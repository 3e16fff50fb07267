// tests/common: the small two-rank schedule worked by hand in test_plan.cpp
// (Costs.SimulatorFollowsTheScheduleModel) and test_timeline.cpp: no overheads, 1 pair/ms forward and 0.5 backward, 1 B/ms links, 2 B per token.
// Rank 0: local 3 pairs, wave 0 1 pair after a 4 ms fetch, wave 1 2 pairs after a 2 ms fetch; rank 1 idle.
#pragma once

#include <vector>

#include "plan/cost.hpp"

namespace treecp::testing {

struct ScheduleCase {
  CostModel costs;
  AttentionShape shape;
  std::vector<RankLoad> loads;
  std::vector<WaveTraffic> waves;
};

inline ScheduleCase hand_worked_schedule() {
  ScheduleCase s;
  CostModel& c = s.costs;
  c.stage_launch_ms = 0.0;
  c.range_ms = 0.0;
  c.merge_ms_per_query_token = 0.0;
  c.underfill_pairs = 0;
  c.token_local_forward_ms_per_token = 0.0;
  c.token_local_backward_ms_per_token = 0.0;
  c.local_forward_pairs_per_ms = c.remote_forward_pairs_per_ms = 1.0;
  c.local_backward_pairs_per_ms = c.remote_backward_pairs_per_ms = 0.5;
  c.intra_node = {0.0, 1.0};
  c.rank_bandwidth_bytes_per_ms = 1e9;
  c.kv_bytes_per_element = c.dkv_bytes_per_element = 1;
  s.shape = AttentionShape{1, 1, 1, 1};  // 2 bytes per token both ways
  s.loads.resize(2);
  s.loads[0].local = {3, 0, 0};
  s.loads[0].waves = {{1, 0, 1}, {2, 0, 1}};
  s.loads[1].waves = {{0, 0, 0}, {0, 0, 0}};
  s.waves.assign(2, WaveTraffic(4, 0));
  s.waves[0][1 * 2 + 0] = 2;  // 2 tokens = 4 B at 1 B/ms: 4 ms
  s.waves[1][1 * 2 + 0] = 1;  // 1 token = 2 B: 2 ms
  return s;
}

}  // namespace treecp::testing
