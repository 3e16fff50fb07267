// GDN/KDA CP (runtime/gdn_cp.hpp) and the short convolution's CP (runtime/conv_cp.hpp) through the CUDA backend
// on one GPU: 1-4 ranks as threads sharing the device over the thread communicator (exchanges landing late and
// out of order, device copies), on tree rows with branching and on rows of packed documents, with local, chained
// and mixed plans, each in bf16 and in fp16 (the backend's dtype; the tests' parameter). Every output and gradient
// is held against the CPU double reference on the same 16-bit inputs (the token recurrence over the tree; the
// convolution by explicit root-to-token paths): error <= 8 x the error of the same CP run on the CPU backend in
// float against it, + 1e-6, + one rounding of the 16-bit type (2^-8 bf16, 2^-11 fp16) for the 16-bit outputs.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "comm/thread_communicator.hpp"
#include "common/gdn.hpp"
#include "common/gdn_cuda.hpp"  // rel_err, expect_within, the tolerance constants
#include "common/threads.hpp"
#include "cuda_test_util.hpp"
#include "plan/gdn_plan.hpp"
#include "plan/ownership.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/cuda_backend.hpp"
#include "runtime/gdn_cp.hpp"
#include "runtime/row_map.hpp"

namespace treecp {
namespace {

using cuda::gdn_test::Bf16Array;
using cuda::gdn_test::expect_within;
using cuda::gdn_test::kAtol;
using cuda::gdn_test::kErrFactor;
using cuda::gdn_test::rounding;
using cuda::gdn_test::rel_err;
using cuda::test::put_rows;
using testing::GdnData;

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
double bf(uint16_t x) { return cuda::test::from_bf16(x); }
double hf(uint16_t x) { return cuda::bits_to_f32(x, cuda::DType::kF16); }
double fl(float x) { return x; }
// The value of a 16-bit element of type t.
auto value16(cuda::DType t) { return t == cuda::DType::kF16 ? hf : bf; }

// The tests' parameter: the CUDA backend's dtype (the inputs rounded to it).
class DtypeCP : public ::testing::TestWithParam<cuda::DType> {};
std::string dtype_name(const ::testing::TestParamInfo<cuda::DType>& info) {
  return cuda::gdn_test::dtype_label(info.param);
}

// The thread communicator sums host memory; a GPU backend's all-reduce operands live on the device (NCCL sums
// them there). This one stages each all-reduce through the host (either kind of pointer: all_ok's flag is a host
// word) and forwards everything else.
class HostStagedReduce final : public Communicator {
 public:
  explicit HostStagedReduce(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void all_to_all_v(const void* send, const std::vector<int64_t>& sc, const std::vector<int64_t>& sd, void* recv,
                    const std::vector<int64_t>& rc, const std::vector<int64_t>& rd, CommType type) override {
    inner_.all_to_all_v(send, sc, sd, recv, rc, rd, type);
  }
  std::unique_ptr<Pending> start_all_to_all_v(const void* send, const std::vector<int64_t>& sc,
                                               const std::vector<int64_t>& sd, void* recv,
                                               const std::vector<int64_t>& rc, const std::vector<int64_t>& rd,
                                               CommType type) override {
    return inner_.start_all_to_all_v(send, sc, sd, recv, rc, rd, type);
  }
  void group_send_recv(const std::vector<P2POp>& ops, CommType type) override { inner_.group_send_recv(ops, type); }
  void all_reduce_sum(void* data, int64_t count, CommType type) override {
    std::vector<char> host(static_cast<size_t>(count) * comm_type_size(type));
    cuda::check_cuda(cudaDeviceSynchronize(), "staged all-reduce: wait");
    cuda::check_cuda(cudaMemcpy(host.data(), data, host.size(), cudaMemcpyDefault), "staged all-reduce: down");
    inner_.all_reduce_sum(host.data(), count, type);
    cuda::check_cuda(cudaMemcpy(data, host.data(), host.size(), cudaMemcpyDefault), "staged all-reduce: up");
    // the upload may still be in flight on the legacy stream, which the backend's stream does not wait for
    cuda::check_cuda(cudaDeviceSynchronize(), "staged all-reduce: landed");
  }
  void all_gather(const void* send, void* recv, int64_t count, CommType type) override {
    inner_.all_gather(send, recv, count, type);
  }
  void barrier() override { inner_.barrier(); }

 private:
  Communicator& inner_;
};

// The GPU's error against the double oracle within 8 x the same CP run's on CpuBackend<float> (`same`), + 1e-6,
// + `extra` (a bf16 rounding for bf16 outputs).
void expect(const char* name, const std::vector<double>& got, const std::vector<double>& same,
            const std::vector<double>& oracle, double extra) {
  const double e32 = rel_err(same, oracle);
  expect_within(name, rel_err(got, oracle), e32, kErrFactor * e32 + kAtol + extra);
}

// ---- GDN / KDA

// The whole row's inputs rounded to the 16-bit type t: the bits the GPU reads, and GdnData holding the same values
// (what every CPU run reads).
struct RowData {
  GdnData d;
  std::vector<uint16_t> q, k, v, g, beta, dy;
  cuda::DType dtype;
};
RowData round_to(GdnData d, cuda::DType t = cuda::DType::kBf16) {
  RowData r;
  r.dtype = t;
  auto take = [t](std::vector<double>& x, std::vector<uint16_t>& bits) {
    const Bf16Array a(x, t);
    bits = a.bits;
    x = a.val;
  };
  take(d.q, r.q); take(d.k, r.k); take(d.v, r.v); take(d.g, r.g); take(d.beta, r.beta); take(d.dy, r.dy);
  r.d = std::move(d);
  return r;
}

struct GdnResult {
  std::vector<double> y, dq, dk, dv, dg, dbeta;
};
GdnResult empty_result(const GdnData& d) {
  return {std::vector<double>(d.v.size()), std::vector<double>(d.q.size()), std::vector<double>(d.k.size()),
          std::vector<double>(d.v.size()), std::vector<double>(d.g.size()), std::vector<double>(d.beta.size())};
}

// fla: the FLA-like split where it takes (bf16_tensor_scans products); keep: its forward kept for the backward
// (CudaBackend::set_gdn_keep_forward), kept_bytes then the bytes rank 0 held between the two; forward_y false: the
// forward computes the states only (set_gdn_forward_y), y then not downloaded (left zero here).
GdnResult run_gdn_cuda(const Row& row, const GdnPlan& plan, const GdnShape& shape, const RowData& in, bool fla = false,
                       bool keep = false, int64_t* kept_bytes = nullptr, bool forward_y = true) {
  const GdnData& d = in.d;
  GdnResult out = empty_result(d);
  std::mutex lock;
  const int64_t qk = shape.qk_width(), vw = shape.v_width(), gw = shape.g_width(), H = shape.heads;
  testing::on_threads(plan.ranks, cuda::test::device_thread_comm(static_cast<uint64_t>(row.tokens())),
                      [&](int rank, Communicator& comm) {
    cuda::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    CudaBackend be(nullptr, in.dtype);
    if (fla) {
      be.set_gdn_precision(cuda::GdnPrecision::bf16_tensor_scans);
      be.set_gdn_fla_split(true);
    }
    be.set_gdn_keep_forward(keep);
    be.set_gdn_forward_y(forward_y);
    GdnCP<CudaBackend> cp(plan, row, shape, comm, be);
    const std::vector<TokenRange> mine = gdn_rank_ranges(row, plan, rank);
    const int64_t rows = cp.owned_rows();
    auto up = [&](const std::vector<uint16_t>& full, int64_t w) {
      CudaBackend::Act b = be.alloc_act(rows * w);
      be.upload(b, rows_of<uint16_t>(full, w, mine));
      return b;
    };
    const CudaBackend::Act q = up(in.q, qk), k = up(in.k, qk), v = up(in.v, vw), g = up(in.g, gw),
                           beta = up(in.beta, H), dy = up(in.dy, vw);
    CudaBackend::Act y = be.alloc_act(rows * vw);
    CudaBackend::Grad dq = be.alloc_grad(rows * qk), dk = be.alloc_grad(rows * qk), dv = be.alloc_grad(rows * vw),
                      dg = be.alloc_grad(rows * gw), dbeta = be.alloc_grad(rows * H);
    cp.forward(q, k, v, g, beta, y);
    if (kept_bytes && rank == 0) *kept_bytes = be.gdn_kept_bytes();
    cp.backward(dy, dq, dk, dv, dg, dbeta);
    const auto yh = be.download(y);
    const auto dqh = be.download(dq), dkh = be.download(dk), dvh = be.download(dv), dgh = be.download(dg),
               dbh = be.download(dbeta);
    std::lock_guard<std::mutex> hold(lock);
    if (forward_y) put_rows<uint16_t>(out.y, yh, vw, mine, value16(in.dtype));
    put_rows<float>(out.dq, dqh, qk, mine, fl);
    put_rows<float>(out.dk, dkh, qk, mine, fl);
    put_rows<float>(out.dv, dvh, vw, mine, fl);
    put_rows<float>(out.dg, dgh, gw, mine, fl);
    put_rows<float>(out.dbeta, dbh, H, mine, fl);
  });
  return out;
}

// The same plan on the CPU backend in float, ranks as threads.
GdnResult run_gdn_cpu_float(const Row& row, const GdnPlan& plan, const GdnShape& shape, const GdnData& d) {
  GdnResult out = empty_result(d);
  std::mutex lock;
  testing::on_threads(plan.ranks, ThreadCommOptions{}, [&](int rank, Communicator& comm) {
    const std::vector<TokenRange> mine = gdn_rank_ranges(row, plan, rank);
    const auto r = testing::run_gdn_cp(comm, row, plan, shape, testing::gdn_buffers<float>(d, mine));
    std::lock_guard<std::mutex> hold(lock);
    put_rows<float>(out.y, r.y, shape.v_width(), mine, fl);
    put_rows<float>(out.dq, r.dq, shape.qk_width(), mine, fl);
    put_rows<float>(out.dk, r.dk, shape.qk_width(), mine, fl);
    put_rows<float>(out.dv, r.dv, shape.v_width(), mine, fl);
    put_rows<float>(out.dg, r.dg, shape.g_width(), mine, fl);
    put_rows<float>(out.dbeta, r.dbeta, shape.heads, mine, fl);
  });
  return out;
}

// Every output and gradient of a GPU run against the double reference, within the float CPU run's error.
void expect_gdn(const GdnResult& gpu, const GdnResult& f32, const testing::GdnReference& ref, cuda::DType t) {
  expect(t == cuda::DType::kF16 ? "y (fp16)" : "y (bf16)", gpu.y, f32.y, ref.y, rounding(t));
  expect("dq", gpu.dq, f32.dq, ref.dq, 0);
  expect("dk", gpu.dk, f32.dk, ref.dk, 0);
  expect("dv", gpu.dv, f32.dv, ref.dv, 0);
  expect("dg", gpu.dg, f32.dg, ref.dg, 0);
  expect("dbeta", gpu.dbeta, f32.dbeta, ref.dbeta, 0);
}

struct GdnCase {
  const char* name;
  bool documents;  // a row of packed documents (roots only), else a tree with branching
  int ranks;
  GdnGate gate;
  int dk;
  int chain;  // 0: no segment chained, 1: every segment, 2: every other one
};

class GdnCudaDtypeCP : public DtypeCP {};

TEST_P(GdnCudaDtypeCP, EqualsTheDoubleReferenceAtOneToFourRanks) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  TREECP_SEED_TRACE;
  const std::vector<GdnCase> cases = {
      {"gdn tree", false, 1, GdnGate::Scalar, 64, 2},      {"gdn tree", false, 2, GdnGate::Scalar, 64, 2},
      {"kda tree", false, 3, GdnGate::PerChannel, 64, 0},  {"kda tree", false, 4, GdnGate::PerChannel, 128, 2},
      {"gdn docs", true, 4, GdnGate::Scalar, 128, 1},      {"kda docs", true, 3, GdnGate::PerChannel, 128, 1},
      {"gdn docs", true, 2, GdnGate::Scalar, 64, 2},
  };
  uint64_t salt = 700;
  for (const GdnCase& c : cases) {
    testing::Rng rng = testing::test_rng(salt++);
    const Row row = c.documents ? Row(std::vector<Segment>{{-1, 333}, {-1, 70}, {-1, 1}, {-1, 190}, {-1, 129}})
                                : testing::random_tree(rng, {.segments = 10, .max_len = 120, .max_depth = 4});
    const GdnShape shape{2, c.dk, c.dk, c.gate, 1.0 / std::sqrt(c.dk), 64};
    std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
    for (size_t s = 0; s < chained.size(); ++s) chained[s] = c.chain == 1 || (c.chain == 2 && s % 2 == 0);
    const GdnPlan plan = make_gdn_plan(row, c.ranks, chained);
    const RowData in = round_to(testing::random_gdn_data(row.tokens(), shape.heads, c.dk, c.dk, c.gate, rng), GetParam());
    const std::string what = std::string(c.name) + " ranks " + std::to_string(c.ranks) + " dk " +
                             std::to_string(c.dk) + " S " + std::to_string(row.tokens());
    SCOPED_TRACE(what);
    std::printf("  %s\n", what.c_str());
    const testing::GdnReference ref = testing::gdn_tree_reference(row, in.d, shape.scale);
    const GdnResult f32 = run_gdn_cpu_float(row, plan, shape, in.d), gpu = run_gdn_cuda(row, plan, shape, in);
    expect_gdn(gpu, f32, ref, GetParam());
  }
}

// Rows of packed documents in the layouts attention uses (plan/gdn_plan.hpp's gdn_layout_plan): chains whose pieces
// are not in rank order (zigzag), a rank holding two pieces of one document, ragged per-document pieces, and a
// document longer than a rank's share; GDN and KDA gates at 2 and 4 ranks.
TEST_P(GdnCudaDtypeCP, EveryLayoutEqualsTheDoubleReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  TREECP_SEED_TRACE;
  const Row row(std::vector<Segment>{{-1, 517}, {-1, 3}, {-1, 96}, {-1, 260}, {-1, 41}});
  uint64_t salt = 800;
  for (const GdnLayout layout : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag}) {
    for (const int ranks : {2, 4}) {
      const GdnGate gate = ranks == 2 ? GdnGate::Scalar : GdnGate::PerChannel;
      testing::Rng rng = testing::test_rng(salt++);
      const GdnShape shape{2, 64, 64, gate, 0.125, 64};
      const GdnPlan plan = gdn_layout_plan(row, ranks, layout);
      const RowData in = round_to(testing::random_gdn_data(row.tokens(), shape.heads, 64, 64, gate, rng), GetParam());
      const std::string what = std::string(gdn_layout_name(layout)) + " ranks " + std::to_string(ranks) +
                               (gate == GdnGate::Scalar ? " gdn" : " kda") + " chains " +
                               std::to_string(plan.chained_segments());
      SCOPED_TRACE(what);
      std::printf("  %s\n", what.c_str());
      const testing::GdnReference ref = testing::gdn_tree_reference(row, in.d, shape.scale);
      const GdnResult f32 = run_gdn_cpu_float(row, plan, shape, in.d), gpu = run_gdn_cuda(row, plan, shape, in);
      expect_gdn(gpu, f32, ref, GetParam());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, GdnCudaDtypeCP, ::testing::Values(cuda::DType::kBf16, cuda::DType::kF16), dtype_name);

// The FLA-like split with its forwards kept for the backward (CudaBackend::set_gdn_keep_forward): the kept backward
// reads the arrays the recomputing one computes again, so every output and gradient is the recomputing run's bit for
// bit, over a tree with chained and unchained segments and packed documents at 1 to 3 ranks; rank 0 holds kept arrays
// between the two calls only with keep on. A kept forward of the states only (set_gdn_forward_y(false), as the
// Python op's backward runs it) gives the same gradients. (The split's accuracy against the recurrence: tests/cuda/test_gdn_cuda.cpp.)
TEST(GdnCudaCP, KeptSplitForwardEqualsTheRecomputingBackward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  TREECP_SEED_TRACE;
  uint64_t salt = 900;
  for (const bool documents : {false, true})
    for (const int ranks : {1, 2, 3}) {
      testing::Rng rng = testing::test_rng(salt++);
      const Row row = documents ? Row(std::vector<Segment>{{-1, 333}, {-1, 70}, {-1, 1}, {-1, 190}})
                                : testing::random_tree(rng, {.segments = 10, .max_len = 120, .max_depth = 4});
      const GdnShape shape{2, 128, 128, GdnGate::Scalar, 1.0 / std::sqrt(128.0), 64};
      std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
      for (size_t s = 0; s < chained.size(); ++s) chained[s] = s % 2 == 0;
      const GdnPlan plan = make_gdn_plan(row, ranks, chained);
      const RowData in = round_to(testing::random_gdn_data(row.tokens(), shape.heads, 128, 128, GdnGate::Scalar, rng));
      SCOPED_TRACE(std::string(documents ? "docs" : "tree") + " ranks " + std::to_string(ranks));
      int64_t kept = -1, none = -1;
      const GdnResult a = run_gdn_cuda(row, plan, shape, in, true, false, &none);
      const GdnResult b = run_gdn_cuda(row, plan, shape, in, true, true, &kept);
      EXPECT_EQ(none, 0);
      EXPECT_GT(kept, 0);
      auto expect_same = [&](const GdnResult& x, bool with_y) {
        if (with_y) EXPECT_EQ(a.y, x.y);
        EXPECT_EQ(a.dq, x.dq);
        EXPECT_EQ(a.dk, x.dk);
        EXPECT_EQ(a.dv, x.dv);
        EXPECT_EQ(a.dg, x.dg);
        EXPECT_EQ(a.dbeta, x.dbeta);
      };
      expect_same(b, true);
      expect_same(run_gdn_cuda(row, plan, shape, in, true, true, nullptr, false), false);  // y not computed there
    }
}

// ---- the short convolution

struct ConvData {
  Bf16Array x, w, b;
  std::vector<float> dy;  // fp32 values (the backward's dy is a gradient buffer)
};

struct ConvResult {
  std::vector<double> y, dx, dw, db;
};

ConvResult run_conv_cuda(const Row& row, const Ownership& layout, const ConvShape& shape, const ConvData& in, bool bias,
                         cuda::DType t) {
  const int64_t S = row.tokens(), C = shape.channels, K = shape.width;
  ConvResult out{std::vector<double>(static_cast<size_t>(S * C)), std::vector<double>(static_cast<size_t>(S * C)),
                 std::vector<double>(static_cast<size_t>(C * K)), std::vector<double>(static_cast<size_t>(C))};
  std::mutex lock;
  testing::on_threads(static_cast<int>(layout.size()), cuda::test::device_thread_comm(static_cast<uint64_t>(S)),
                      [&](int rank, Communicator& thread_comm) {
    cuda::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    HostStagedReduce comm(thread_comm);
    CudaBackend be(nullptr, t);
    ConvCP<CudaBackend> cp(layout, row, shape, comm, be);
    const std::vector<TokenRange>& mine = layout[static_cast<size_t>(rank)];
    const int64_t rows = cp.owned_rows();
    auto up_act = [&](const std::vector<uint16_t>& host) {
      CudaBackend::Act b = be.alloc_act(static_cast<int64_t>(host.size()));
      be.upload(b, host);
      return b;
    };
    const CudaBackend::Act x = up_act(rows_of<uint16_t>(in.x.bits, C, mine)), w = up_act(in.w.bits),
                           b = up_act(in.b.bits);
    CudaBackend::Grad dy = be.alloc_grad(rows * C);
    be.upload(dy, rows_of<float>(in.dy, C, mine));
    CudaBackend::Act y = be.alloc_act(rows * C);
    CudaBackend::Grad dx = be.alloc_grad(rows * C), dw = be.alloc_grad(C * K), db = be.alloc_grad(C);
    cp.forward(x, w, bias ? &b : nullptr, y);
    cp.backward(dy, dx, dw, bias ? &db : nullptr);
    const auto yh = be.download(y);
    const auto dxh = be.download(dx), dwh = be.download(dw), dbh = be.download(db);
    std::lock_guard<std::mutex> hold(lock);
    put_rows<uint16_t>(out.y, yh, C, mine, value16(t));
    put_rows<float>(out.dx, dxh, C, mine, fl);
    if (rank == 0) {  // the weight gradients are summed over the ranks: every rank holds the total
      out.dw.assign(dwh.begin(), dwh.end());
      if (bias) out.db.assign(dbh.begin(), dbh.end());
    }
  });
  return out;
}

ConvResult run_conv_cpu_float(const Row& row, const Ownership& layout, const ConvShape& shape, const ConvData& in,
                              bool bias) {
  const int64_t S = row.tokens(), C = shape.channels, K = shape.width;
  ConvResult out{std::vector<double>(static_cast<size_t>(S * C)), std::vector<double>(static_cast<size_t>(S * C)),
                 std::vector<double>(static_cast<size_t>(C * K)), std::vector<double>(static_cast<size_t>(C))};
  std::mutex lock;
  testing::on_threads(static_cast<int>(layout.size()), ThreadCommOptions{}, [&](int rank, Communicator& comm) {
    CpuBackend<float> be;
    ConvCP<CpuBackend<float>> cp(layout, row, shape, comm, be);
    const std::vector<TokenRange>& mine = layout[static_cast<size_t>(rank)];
    const int64_t rows = cp.owned_rows();
    const std::vector<float> x = rows_of<float>(in.x.val, C, mine), w(in.w.val.begin(), in.w.val.end()),
                             b(in.b.val.begin(), in.b.val.end()), dy = rows_of<float>(in.dy, C, mine);
    std::vector<float> y(static_cast<size_t>(rows * C)), dx(y.size()), dw(static_cast<size_t>(C * K)),
        db(static_cast<size_t>(C));
    cp.forward(x, w, bias ? &b : nullptr, y);
    cp.backward(dy, dx, dw, bias ? &db : nullptr);
    std::lock_guard<std::mutex> hold(lock);
    put_rows<float>(out.y, y, C, mine, fl);
    put_rows<float>(out.dx, dx, C, mine, fl);
    if (rank == 0) {
      out.dw.assign(dw.begin(), dw.end());
      if (bias) out.db.assign(db.begin(), db.end());
    }
  });
  return out;
}

class ConvCudaCP : public DtypeCP {};

TEST_P(ConvCudaCP, EqualsTheDoubleReferenceAtOneToFourRanks) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  TREECP_SEED_TRACE;
  const cuda::DType t = GetParam();
  struct Case {
    bool documents;
    int ranks, channels, width;
    bool silu, bias, zigzag;
  };
  const std::vector<Case> cases = {{false, 1, 256, 4, true, true, false}, {false, 2, 300, 4, true, true, false},
                                   {false, 3, 128, 3, false, false, true}, {false, 4, 512, 4, true, true, true},
                                   {true, 4, 256, 4, true, false, false}};
  uint64_t salt = 800;
  for (const Case& c : cases) {
    testing::Rng rng = testing::test_rng(salt++);
    // Short segments (single tokens among them) make halos that reach across several ranks.
    const Row row = c.documents ? Row(std::vector<Segment>{{-1, 200}, {-1, 2}, {-1, 90}, {-1, 131}})
                                : testing::random_tree(rng, {.segments = 14, .max_len = 60, .single_token = 0.3});
    const int64_t S = row.tokens();
    // zigzag: the GDN plan's ownership of a mixed chained set (pieces of segments on every rank).
    std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
    for (size_t s = 0; s < chained.size(); ++s) chained[s] = s % 2 == 0;
    const Ownership layout = c.zigzag ? gdn_ownership(row, make_gdn_plan(row, c.ranks, chained))
                                      : contiguous_ownership(S, c.ranks);
    const ConvShape shape{c.channels, c.width, c.silu};
    const ConvData in{Bf16Array(testing::randn(static_cast<size_t>(S * c.channels), rng), t),
                      Bf16Array(testing::randn(static_cast<size_t>(c.channels * c.width), rng, 0.5), t),
                      Bf16Array(testing::randn(static_cast<size_t>(c.channels), rng), t),
                      [&] {
                        const auto v = testing::randn(static_cast<size_t>(S * c.channels), rng);
                        return std::vector<float>(v.begin(), v.end());
                      }()};
    const std::string what = std::string(c.documents ? "docs" : "tree") + " ranks " + std::to_string(c.ranks) +
                             " C " + std::to_string(c.channels) + " K " + std::to_string(c.width) + " S " +
                             std::to_string(S);
    SCOPED_TRACE(what);
    std::printf("  %s\n", what.c_str());
    const std::vector<double> dyd(in.dy.begin(), in.dy.end());
    const testing::ConvReference ref = testing::conv_tree_reference(
        row, in.x.val, in.w.val, c.bias ? in.b.val : std::vector<double>{}, c.channels, c.width, c.silu, dyd);
    const ConvResult f32 = run_conv_cpu_float(row, layout, shape, in, c.bias),
                     gpu = run_conv_cuda(row, layout, shape, in, c.bias, t);
    expect(t == cuda::DType::kF16 ? "conv y (fp16)" : "conv y (bf16)", gpu.y, f32.y, ref.y, rounding(t));
    expect("conv dx", gpu.dx, f32.dx, ref.dx, 0);
    expect("conv dweight", gpu.dw, f32.dw, ref.dw, 0);
    if (c.bias) expect("conv dbias", gpu.db, f32.db, ref.db, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, ConvCudaCP, ::testing::Values(cuda::DType::kBf16, cuda::DType::kF16), dtype_name);

// A second and third step of the same GDN and conv layers allocate no device memory: every scratch (the chunk
// kernels' workspace, the gathered maps, the uploaded predecessor rows) comes back from the pool.
TEST(GdnCudaCP, SteadyStateAllocatesNothing) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  testing::Rng rng = testing::test_rng(900);
  const Row row = testing::random_tree(rng, {.segments = 8, .max_len = 200});
  const int64_t S = row.tokens();
  const GdnShape shape{2, 64, 64, GdnGate::PerChannel, 0.125, 64};
  std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()), 1);
  const GdnPlan plan = make_gdn_plan(row, 1, chained);
  const RowData in = round_to(testing::random_gdn_data(S, 2, 64, 64, GdnGate::PerChannel, rng));
  // One thread rank whose parts move by cudaMemcpy (the chained plan sends states to itself, which the host-memory
  // self communicator cannot copy), its all-reduce (conv's dweight) staged through the host.
  auto comms = make_thread_communicators(1, cuda::test::device_thread_comm(static_cast<uint64_t>(S)));
  HostStagedReduce staged(*comms[0]);
  Communicator* comm = &staged;
  CudaBackend be;
  GdnCP<CudaBackend> cp(plan, row, shape, *comm, be);
  const ConvShape cs{static_cast<int>(shape.qk_width()), 4, true};
  ConvCP<CudaBackend> conv(contiguous_ownership(S, 1), row, cs, *comm, be);
  auto up = [&](const std::vector<uint16_t>& host) {
    CudaBackend::Act b = be.alloc_act(static_cast<int64_t>(host.size()));
    be.upload(b, host);
    return b;
  };
  const CudaBackend::Act q = up(in.q), k = up(in.k), v = up(in.v), g = up(in.g), beta = up(in.beta), dy = up(in.dy);
  const CudaBackend::Act w = up(std::vector<uint16_t>(static_cast<size_t>(cs.channels * cs.width), cuda::test::to_bf16(0.25f)));
  CudaBackend::Act y = be.alloc_act(S * shape.v_width()), u = be.alloc_act(S * cs.channels);
  CudaBackend::Grad dq = be.alloc_grad(S * shape.qk_width()), dk = be.alloc_grad(S * shape.qk_width()),
                    dv = be.alloc_grad(S * shape.v_width()), dg = be.alloc_grad(S * shape.g_width()),
                    dbeta = be.alloc_grad(S * shape.heads), dx = be.alloc_grad(S * cs.channels),
                    dw = be.alloc_grad(cs.channels * cs.width);
  for (int step = 0; step < 3; ++step) {
    const int64_t before = be.pool().device_mallocs();
    for (CudaBackend::Grad* x : {&dq, &dk, &dv, &dg, &dbeta, &dx, &dw}) be.zero(*x);  // they accumulate
    conv.forward(q, w, nullptr, u);
    cp.forward(u, k, v, g, beta, y);
    cp.backward(dy, dq, dk, dv, dg, dbeta);
    conv.backward(dq, dx, dw, nullptr);
    be.synchronize();
    if (step > 0) {
      EXPECT_EQ(be.pool().device_mallocs(), before) << "step " << step;
    }
  }
}

// The hybrid stack (runtime/hybrid.hpp) does not instantiate over CudaBackend: it feeds each layer's dy (an Act,
// bf16) from the layer above's input gradients (Grad, fp32) in one buffer type, and says so by a static_assert.

}  // namespace
}  // namespace treecp
