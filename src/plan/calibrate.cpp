#include "plan/calibrate.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"

namespace treecp {

namespace {

// Solves the normal equations of the columns in `set` (Gaussian elimination with partial pivoting); the
// other entries of the result are 0.
std::vector<double> least_squares_on(const std::vector<double>& a, const std::vector<double>& b, int rows, int cols,
                                     const std::vector<bool>& set) {
  std::vector<int> idx;
  for (int j = 0; j < cols; ++j)
    if (set[static_cast<size_t>(j)]) idx.push_back(j);
  const int n = static_cast<int>(idx.size());
  std::vector<double> m(static_cast<size_t>(n * (n + 1)), 0.0);
  for (int i = 0; i < rows; ++i) {
    for (int p = 0; p < n; ++p) {
      const double ap = a[static_cast<size_t>(i * cols + idx[p])];
      for (int q = 0; q < n; ++q) m[static_cast<size_t>(p * (n + 1) + q)] += ap * a[static_cast<size_t>(i * cols + idx[q])];
      m[static_cast<size_t>(p * (n + 1) + n)] += ap * b[static_cast<size_t>(i)];
    }
  }
  for (int c = 0; c < n; ++c) {
    int piv = c;
    for (int r = c + 1; r < n; ++r)
      if (std::abs(m[static_cast<size_t>(r * (n + 1) + c)]) > std::abs(m[static_cast<size_t>(piv * (n + 1) + c)])) piv = r;
    for (int k = 0; k <= n; ++k) std::swap(m[static_cast<size_t>(c * (n + 1) + k)], m[static_cast<size_t>(piv * (n + 1) + k)]);
    const double d = m[static_cast<size_t>(c * (n + 1) + c)];
    if (std::abs(d) < 1e-300) continue;  // a column with no information stays 0
    for (int r = 0; r < n; ++r) {
      if (r == c) continue;
      const double f = m[static_cast<size_t>(r * (n + 1) + c)] / d;
      for (int k = c; k <= n; ++k) m[static_cast<size_t>(r * (n + 1) + k)] -= f * m[static_cast<size_t>(c * (n + 1) + k)];
    }
  }
  std::vector<double> x(static_cast<size_t>(cols), 0.0);
  for (int p = 0; p < n; ++p) {
    const double d = m[static_cast<size_t>(p * (n + 1) + p)];
    x[static_cast<size_t>(idx[p])] = std::abs(d) < 1e-300 ? 0.0 : m[static_cast<size_t>(p * (n + 1) + n)] / d;
  }
  return x;
}

}  // namespace

std::vector<double> nnls(const std::vector<double>& a, const std::vector<double>& b, int rows, int cols) {
  require(static_cast<int64_t>(a.size()) == int64_t{rows} * cols && static_cast<int>(b.size()) == rows,
          "nnls: a must be rows x cols and b rows long");
  std::vector<double> x(static_cast<size_t>(cols), 0.0);
  std::vector<bool> passive(static_cast<size_t>(cols), false);
  auto gradient = [&](const std::vector<double>& xv) {  // A^T (b - A x)
    std::vector<double> w(static_cast<size_t>(cols), 0.0);
    for (int i = 0; i < rows; ++i) {
      double r = b[static_cast<size_t>(i)];
      for (int j = 0; j < cols; ++j) r -= a[static_cast<size_t>(i * cols + j)] * xv[static_cast<size_t>(j)];
      for (int j = 0; j < cols; ++j) w[static_cast<size_t>(j)] += a[static_cast<size_t>(i * cols + j)] * r;
    }
    return w;
  };
  for (int outer = 0; outer < 3 * cols + 10; ++outer) {
    const std::vector<double> w = gradient(x);
    int best = -1;
    double best_w = 1e-12;
    for (int j = 0; j < cols; ++j)
      if (!passive[static_cast<size_t>(j)] && w[static_cast<size_t>(j)] > best_w) best = j, best_w = w[static_cast<size_t>(j)];
    if (best < 0) break;
    passive[static_cast<size_t>(best)] = true;
    for (int inner = 0; inner < 3 * cols + 10; ++inner) {
      const std::vector<double> z = least_squares_on(a, b, rows, cols, passive);
      bool feasible = true;
      for (int j = 0; j < cols; ++j)
        if (passive[static_cast<size_t>(j)] && z[static_cast<size_t>(j)] <= 0) feasible = false;
      if (feasible) {
        x = z;
        break;
      }
      // Step from x towards z as far as x stays >= 0, and drop the columns that reach 0.
      double alpha = 1.0;
      for (int j = 0; j < cols; ++j) {
        if (passive[static_cast<size_t>(j)] && z[static_cast<size_t>(j)] <= 0) {
          const double denom = x[static_cast<size_t>(j)] - z[static_cast<size_t>(j)];
          if (denom > 0) alpha = std::min(alpha, x[static_cast<size_t>(j)] / denom);
        }
      }
      for (int j = 0; j < cols; ++j) {
        x[static_cast<size_t>(j)] += alpha * (z[static_cast<size_t>(j)] - x[static_cast<size_t>(j)]);
        if (passive[static_cast<size_t>(j)] && x[static_cast<size_t>(j)] <= 1e-300) {
          passive[static_cast<size_t>(j)] = false;
          x[static_cast<size_t>(j)] = 0.0;
        }
      }
    }
  }
  return x;
}

double mean_abs_log_error(const std::vector<std::pair<double, double>>& mp) {
  double sum = 0.0;
  int n = 0;
  for (const auto& [m, p] : mp) {
    if (m <= 0 || p <= 0) continue;
    sum += std::abs(std::log(m / p));
    ++n;
  }
  return n > 0 ? sum / n : 0.0;
}

Calibration calibrate(const CostModel& base, const std::vector<StageSample>& stages,
                      const std::vector<PassSample>& passes, const std::vector<LinkSample>& links) {
  Calibration out;
  out.costs = base;
  CostModel& c = out.costs;
  // ---- stages: unknowns launch, 1/throughput x 4 (local fwd, remote fwd, local bwd, remote bwd), merge, range
  enum { kLaunch, kLf, kRf, kLb, kRb, kMerge, kRange, kCols };
  auto cls = [](const StageSample& s) {
    return s.pass == Pass::Forward ? (s.remote ? kRf : kLf) : (s.remote ? kRb : kLb);
  };
  // With few samples (fewer than three per unknown) only the throughputs are fitted: launch, merge and range
  // keep the base values (their share is subtracted first), rather than an intercept fitted to six points.
  int usable = 0;
  for (const StageSample& s : stages) usable += s.measured_ms > 0 && s.load.pairs > 0;
  const bool fit_fixed_terms = usable >= 3 * kCols;
  std::vector<double> a, b;
  int rows = 0;
  bool seen[kCols] = {};
  for (const StageSample& s : stages) {
    if (s.measured_ms <= 0 || s.load.pairs <= 0) continue;
    const double inv = 1.0 / s.measured_ms;  // relative error
    double row[kCols] = {};
    row[kLaunch] = 1.0;
    row[cls(s)] = static_cast<double>(std::max(s.load.pairs, s.load.compute_pairs));  // stage_ms's computed pairs
    if (s.remote) row[kMerge] = static_cast<double>(s.load.query_tokens);
    row[kRange] = static_cast<double>(s.load.ranges);
    double fixed = 0.0;
    if (!fit_fixed_terms) {  // the base's stage_ms without its pair term (launch, merge, range, underfill)
      StageLoad no_pairs = s.load;
      no_pairs.compute_pairs = 0;
      CostModel no_throughput = base;
      no_throughput.local_forward_pairs_per_ms = no_throughput.remote_forward_pairs_per_ms =
          no_throughput.local_backward_pairs_per_ms = no_throughput.remote_backward_pairs_per_ms =
              std::numeric_limits<double>::infinity();
      fixed = stage_ms(no_throughput, no_pairs, s.remote, s.pass);
      row[kLaunch] = row[kMerge] = row[kRange] = 0.0;
    }
    for (int j = 0; j < kCols; ++j) {
      a.push_back(row[j] * inv);
      seen[j] = seen[j] || row[j] != 0.0;
    }
    b.push_back(1.0 - fixed * inv);
    ++rows;
  }
  out.stage_samples = rows;
  if (rows > 0) {
    // Unseen columns stay out of the fit (their coefficients keep the base values).
    std::vector<int> keep;
    for (int j = 0; j < kCols; ++j)
      if (seen[j]) keep.push_back(j);
    std::vector<double> sub;
    for (int i = 0; i < rows; ++i)
      for (int j : keep) sub.push_back(a[static_cast<size_t>(i * kCols + j)]);
    const std::vector<double> x = nnls(sub, b, rows, static_cast<int>(keep.size()));
    double fit[kCols] = {};
    for (size_t k = 0; k < keep.size(); ++k) fit[keep[k]] = x[k];
    if (fit_fixed_terms) c.underfill_ms = 0.0;  // its effect is in the fitted launch
    if (seen[kLaunch]) c.stage_launch_ms = fit[kLaunch];
    auto throughput = [&](int col, double& field) {
      if (seen[col] && fit[col] > 0) field = 1.0 / fit[col];
    };
    throughput(kLf, c.local_forward_pairs_per_ms);
    throughput(kRf, c.remote_forward_pairs_per_ms);
    throughput(kLb, c.local_backward_pairs_per_ms);
    throughput(kRb, c.remote_backward_pairs_per_ms);
    if (seen[kMerge]) c.merge_ms_per_query_token = fit[kMerge];
    if (seen[kRange]) c.range_ms = fit[kRange];
    std::vector<std::pair<double, double>> mp;
    for (const StageSample& s : stages)
      if (s.measured_ms > 0 && s.load.pairs > 0) mp.push_back({s.measured_ms, stage_ms(c, s.load, s.remote, s.pass)});
    out.stage_fit_error = mean_abs_log_error(mp);
  }
  // ---- token-local work per pass
  for (Pass pass : {Pass::Forward, Pass::Backward}) {
    double num = 0, den = 0;
    for (const PassSample& p : passes) {
      if (p.pass != pass || p.owned_tokens <= 0) continue;
      const double rest = std::max(0.0, p.measured_ms - p.measured_stages_ms);
      num += rest * static_cast<double>(p.owned_tokens);
      den += static_cast<double>(p.owned_tokens) * static_cast<double>(p.owned_tokens);
      ++out.pass_samples;
    }
    if (den > 0)
      (pass == Pass::Forward ? c.token_local_forward_ms_per_token : c.token_local_backward_ms_per_token) = num / den;
  }
  // ---- links: two ranks give latency and link bandwidth; more ranks the rank bandwidth
  std::vector<double> la, lb;
  int lrows = 0;
  for (const LinkSample& l : links) {
    if (l.ranks != 2 || l.measured_ms <= 0 || l.bytes_per_peer <= 0) continue;
    const double inv = 1.0 / l.measured_ms;
    la.push_back(inv);
    la.push_back(static_cast<double>(l.bytes_per_peer) * inv);
    lb.push_back(1.0);
    ++lrows;
  }
  out.link_samples = lrows;
  if (lrows >= 2) {
    const std::vector<double> x = nnls(la, lb, lrows, 2);
    c.intra_node.latency_ms = x[0];
    if (x[1] > 0) c.intra_node.bandwidth_bytes_per_ms = 1.0 / x[1];
  }
  std::vector<double> rank_bw;
  for (const LinkSample& l : links) {
    if (l.ranks < 3 || l.measured_ms <= c.intra_node.latency_ms) continue;
    ++out.link_samples;
    rank_bw.push_back(static_cast<double>(l.bytes_per_peer) * (l.ranks - 1) / (l.measured_ms - c.intra_node.latency_ms));
  }
  if (!rank_bw.empty()) {
    std::sort(rank_bw.begin(), rank_bw.end());
    c.rank_bandwidth_bytes_per_ms = rank_bw[rank_bw.size() / 2];
  }
  return out;
}

}  // namespace treecp
