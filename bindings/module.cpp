// treecp._core: rows, plans and the CP runtimes for the Python package. Framework types stay here:
// tensors arrive by DLPack as nb::ndarray (host memory, C order, checked by name in Python first) and
// the core sees raw pointers. treecp::Error becomes ValueError with the library's message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cuda/attention_dims.hpp"
#include "key.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "py_communicator.hpp"
#include "tree/row.hpp"
#if TREECP_HAVE_CUDA && TREECP_HAVE_NCCL
#include "comm/nccl_communicator.hpp"
#endif

// pyproject.toml's floor, enforced where any build meets it (`pip install --no-build-isolation` builds with
// whatever nanobind is installed): nanobind 1.x built an extension whose CPU ops crashed on Python 3.12 (see
// NoGil below) and that refused arrays with no rows.
static_assert(NB_VERSION_MAJOR >= 2, "treecp's extension needs nanobind >= 2.0: python3 -m pip install -U nanobind");

namespace nb = nanobind;
using namespace treecp;

namespace {

template <class T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <class T>
using Out = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

// The core reads and writes each array through a raw pointer, assuming the shape below (tokens first, C
// order): an array of another shape is a ValueError naming it, never an access past its end. The Python
// layer checks the same by name first; this guards the boundary itself (direct calls, any DLPack producer).
template <class A>
void require_shape(const char* op, const char* name, const A& a, std::initializer_list<int64_t> want) {
  bool same = a.ndim() == want.size();
  for (size_t i = 0; same && i < want.size(); ++i) same = static_cast<int64_t>(a.shape(i)) == want.begin()[i];
  if (same) return;
  std::string got, expected;
  for (size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
  for (size_t i = 0; i < want.size(); ++i) expected += (i ? ", " : "") + std::to_string(want.begin()[i]);
  fail(op, ": ", name, " has shape [", got, "], expected [", expected, "]");
}
template <class A>
void require_shape(const char* op, const char* name, const std::optional<A>& a, std::initializer_list<int64_t> want) {
  if (a) require_shape(op, name, *a, want);
}
// Outputs that exist exactly when an optional input does (the sink and the output before it, a bias and its
// gradient): one without the other would leave the core writing through a null pointer.
template <class A, class B>
void require_paired(const char* op, const char* name, const std::optional<A>& a, const char* other,
                    const std::optional<B>& b) {
  require(a.has_value() == b.has_value(), op, ": ", name, a ? " is given without " : " is None but ", other,
          a ? "" : " is given");
}

template <class T>
const T* ptr_or_null(const std::optional<In<T>>& a) {
  return a ? a->data() : nullptr;
}
template <class T>
T* ptr_or_null(std::optional<Out<T>>& a) {
  return a ? a->data() : nullptr;
}

// An int64 NumPy array that owns a copy of `v`.
nb::ndarray<nb::numpy, int64_t, nb::ndim<1>> numpy_of(std::vector<int64_t> v) {
  auto* heap = new std::vector<int64_t>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  return nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

Row make_row(const std::vector<int64_t>& parents, const std::vector<int64_t>& lengths) {
  require(parents.size() == lengths.size(), "parents and lengths must have the same length, got ", parents.size(),
          " and ", lengths.size());
  std::vector<Segment> segs(parents.size());
  for (size_t i = 0; i < parents.size(); ++i) {
    require(parents[i] >= -1 && parents[i] < static_cast<int64_t>(parents.size()), "parents[", i, "] = ", parents[i],
            " is not -1 or a segment index");
    segs[i].parent = static_cast<int32_t>(parents[i]);
    segs[i].length = lengths[i];
  }
  return Row(std::move(segs));
}

std::vector<int64_t> logical_positions(const Row& row) {
  std::vector<int64_t> out(static_cast<size_t>(row.tokens()));
  for (int32_t s = 0; s < row.num_segments(); ++s)
    for (int64_t i = 0; i < row.length(s); ++i) out[static_cast<size_t>(row.start(s) + i)] = row.logical_start(s) + i;
  return out;
}

// A 64-bit digest of what every rank must agree on before it runs a key's collectives.
int64_t fingerprint(const Row& row, const Plan& plan) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](int64_t x) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(x >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  for (const Segment& s : row.segments()) {
    mix(s.parent);
    mix(s.length);
  }
  mix(plan.cp);
  mix(plan.window);
  mix(plan.num_waves);
  for (int64_t b : plan.chunk_bounds) mix(b);
  for (int32_t o : plan.chunk_owner) mix(o);
  return static_cast<int64_t>(h);
}

// The compute calls run without the GIL, so that other Python threads (data loaders, torch's) go on; the
// Python communicator takes it back for each collective. Calls taking raw pointers release it for the whole
// call (Compute); calls taking arrays release it inside their body (NoGil, declared after the checks), so
// that the by-value nb::ndarray parameters, which own references to Python objects, are released with the
// GIL held (nanobind < 1.9 dropped them without taking it, which crashed on Python 3.12; later versions take
// it there themselves, this does not rely on that).
using Compute = nb::call_guard<nb::gil_scoped_release>;
using NoGil = nb::gil_scoped_release;

// Each op family's inputs, checked alike by its forward and its backward (n: this rank's tokens).
template <class T>
void require_attention_inputs(const char* op, int64_t n, int hq, int hkv, int d, int dv, const In<T>& q,
                              const In<T>& k, const In<T>& v, const std::optional<In<T>>& sink) {
  require_shape(op, "q", q, {n, hq, d});
  require_shape(op, "k", k, {n, hkv, d});
  require_shape(op, "v", v, {n, hkv, dv});
  require_shape(op, "sink", sink, {hq});
}
// GDN's gate is [n, heads] (one decay per head) or, per channel (KDA), [n, heads, dk]; its gradient alike.
template <class A>
void require_gate(const char* op, const char* name, const A& g, int64_t n, int heads, int dk, bool per_channel) {
  if (per_channel)
    require_shape(op, name, g, {n, heads, dk});
  else
    require_shape(op, name, g, {n, heads});
}
template <class T>
void require_gdn_inputs(const char* op, int64_t n, int heads, int dk, int dv, bool per_channel, const In<T>& q,
                        const In<T>& k, const In<T>& v, const In<T>& g, const In<T>& beta) {
  require_shape(op, "q", q, {n, heads, dk});
  require_shape(op, "k", k, {n, heads, dk});
  require_shape(op, "v", v, {n, heads, dv});
  require_gate(op, "g", g, n, heads, dk, per_channel);
  require_shape(op, "beta", beta, {n, heads});
}
template <class T>
void require_conv_inputs(const char* op, int64_t n, int channels, int width, const In<T>& x, const In<T>& weight,
                         const std::optional<In<T>>& bias) {
  require_shape(op, "x", x, {n, channels});
  require_shape(op, "weight", weight, {channels, width});
  require_shape(op, "bias", bias, {channels});
}

template <class T>
void bind_ops(nb::class_<py::KeyCore>& cls) {
  cls.def(
      "attention_forward",
      [](py::KeyCore& key, int hq, int hkv, int d, int dv, double scale, In<T> q, In<T> k, In<T> v,
         std::optional<In<T>> sink, Out<T> y, Out<T> lse, std::optional<Out<T>> o_presink) {
        const char* op = "attention_forward";
        const int64_t n = key.owned_tokens();
        require_attention_inputs<T>(op, n, hq, hkv, d, dv, q, k, v, sink);
        require_shape(op, "y", y, {n, hq, dv});
        require_shape(op, "lse", lse, {n, hq});
        require_paired(op, "sink", sink, "o_presink", o_presink);
        require_shape(op, "o_presink", o_presink, {n, hq, dv});
        NoGil released;
        key.attention_forward<T>({hq, hkv, d, dv, scale}, q.data(), k.data(), v.data(), ptr_or_null(sink), y.data(),
                                 lse.data(), ptr_or_null(o_presink));
      },
      nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("dv"), nb::arg("scale"), nb::arg("q"), nb::arg("k"),
      nb::arg("v"), nb::arg("sink").none(), nb::arg("y"), nb::arg("lse"), nb::arg("o_presink").none());
  cls.def(
      "attention_backward",
      [](py::KeyCore& key, int hq, int hkv, int d, int dv, double scale, In<T> q, In<T> k, In<T> v,
         std::optional<In<T>> sink, In<T> o, In<T> lse, In<T> dy, Out<T> dq, Out<T> dk, Out<T> dv_,
         std::optional<Out<T>> dsink) {
        const char* op = "attention_backward";
        const int64_t n = key.owned_tokens();
        require_attention_inputs<T>(op, n, hq, hkv, d, dv, q, k, v, sink);
        require_shape(op, "o", o, {n, hq, dv});
        require_shape(op, "lse", lse, {n, hq});
        require_shape(op, "dy", dy, {n, hq, dv});
        require_shape(op, "dq", dq, {n, hq, d});
        require_shape(op, "dk", dk, {n, hkv, d});
        require_shape(op, "dv_", dv_, {n, hkv, dv});
        require_shape(op, "dsink", dsink, {hq});
        NoGil released;
        key.attention_backward<T>({hq, hkv, d, dv, scale}, q.data(), k.data(), v.data(), ptr_or_null(sink), o.data(),
                                  lse.data(), dy.data(), dq.data(), dk.data(), dv_.data(), ptr_or_null(dsink));
      },
      nb::arg("hq"), nb::arg("hkv"), nb::arg("d"), nb::arg("dv"), nb::arg("scale"), nb::arg("q"), nb::arg("k"),
      nb::arg("v"), nb::arg("sink").none(), nb::arg("o"), nb::arg("lse"), nb::arg("dy"), nb::arg("dq"), nb::arg("dk"),
      nb::arg("dv_"), nb::arg("dsink").none());
  cls.def(
      "gdn_forward",
      [](py::KeyCore& key, int heads, int dk, int dv, bool per_channel, double scale, int chunk, In<T> q, In<T> k,
         In<T> v, In<T> g, In<T> beta, Out<T> y, bool keep) {
        const char* op = "gdn_forward";
        const int64_t n = key.owned_tokens();
        require_gdn_inputs<T>(op, n, heads, dk, dv, per_channel, q, k, v, g, beta);
        require_shape(op, "y", y, {n, heads, dv});
        NoGil released;
        key.gdn_forward<T>({heads, dk, dv, per_channel, scale, chunk, 0, false, keep}, q.data(), k.data(), v.data(),
                           g.data(), beta.data(), y.data());
      },
      nb::arg("heads"), nb::arg("dk"), nb::arg("dv"), nb::arg("per_channel"), nb::arg("scale"), nb::arg("chunk"),
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("y"), nb::arg("keep") = false);
  cls.def(
      "gdn_backward",
      [](py::KeyCore& key, int heads, int dk, int dv, bool per_channel, double scale, int chunk, In<T> q, In<T> k,
         In<T> v, In<T> g, In<T> beta, In<T> dy, Out<T> dq, Out<T> dk_, Out<T> dv_, Out<T> dg, Out<T> dbeta,
         bool keep) {
        const char* op = "gdn_backward";
        const int64_t n = key.owned_tokens();
        require_gdn_inputs<T>(op, n, heads, dk, dv, per_channel, q, k, v, g, beta);
        require_shape(op, "dy", dy, {n, heads, dv});
        require_shape(op, "dq", dq, {n, heads, dk});
        require_shape(op, "dk_", dk_, {n, heads, dk});
        require_shape(op, "dv_", dv_, {n, heads, dv});
        require_gate(op, "dg", dg, n, heads, dk, per_channel);
        require_shape(op, "dbeta", dbeta, {n, heads});
        NoGil released;
        key.gdn_backward<T>({heads, dk, dv, per_channel, scale, chunk, 0, false, keep}, q.data(), k.data(), v.data(),
                            g.data(), beta.data(), dy.data(), dq.data(), dk_.data(), dv_.data(), dg.data(),
                            dbeta.data());
      },
      nb::arg("heads"), nb::arg("dk"), nb::arg("dv"), nb::arg("per_channel"), nb::arg("scale"), nb::arg("chunk"),
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"), nb::arg("dy"), nb::arg("dq"),
      nb::arg("dk_"), nb::arg("dv_"), nb::arg("dg"), nb::arg("dbeta"), nb::arg("keep") = false);
  cls.def(
      "conv_forward",
      [](py::KeyCore& key, int channels, int width, bool silu, In<T> x, In<T> weight, std::optional<In<T>> bias,
         Out<T> y) {
        const char* op = "conv_forward";
        const int64_t n = key.owned_tokens();
        require_conv_inputs<T>(op, n, channels, width, x, weight, bias);
        require_shape(op, "y", y, {n, channels});
        NoGil released;
        key.conv_forward<T>(channels, width, silu, x.data(), weight.data(), ptr_or_null(bias), y.data());
      },
      nb::arg("channels"), nb::arg("width"), nb::arg("silu"), nb::arg("x"), nb::arg("weight"), nb::arg("bias").none(),
      nb::arg("y"));
  cls.def(
      "conv_backward",
      [](py::KeyCore& key, int channels, int width, bool silu, In<T> x, In<T> weight, std::optional<In<T>> bias,
         In<T> dy, Out<T> dx, Out<T> dweight, std::optional<Out<T>> dbias) {
        const char* op = "conv_backward";
        const int64_t n = key.owned_tokens();
        require_conv_inputs<T>(op, n, channels, width, x, weight, bias);
        require_shape(op, "dy", dy, {n, channels});
        require_shape(op, "dx", dx, {n, channels});
        require_shape(op, "dweight", dweight, {channels, width});
        require_shape(op, "dbias", dbias, {channels});
        NoGil released;
        key.conv_backward<T>(channels, width, silu, x.data(), weight.data(), ptr_or_null(bias), dy.data(), dx.data(),
                             dweight.data(), ptr_or_null(dbias));
      },
      nb::arg("channels"), nb::arg("width"), nb::arg("silu"), nb::arg("x"), nb::arg("weight"), nb::arg("bias").none(),
      nb::arg("dy"), nb::arg("dx"), nb::arg("dweight"), nb::arg("dbias").none());
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "treecp's C++ core: packed prefix-tree rows, plans and the context-parallel runtimes";
  // torch's compiled-graph caches and autograd graphs may hold keys until the interpreter is gone.
  nb::set_leak_warnings(false);
  // Whether the extension was built with the CUDA backend (nvcc found at build time).
  m.attr("has_cuda_backend") = py::KeyCore::has_cuda();
  // Whether CUDA tensors can run under CP: the NCCL communicator the package makes from a torch group.
  m.attr("has_nccl") = py::KeyCore::has_nccl();
  // The (D, Dv) pairs the CUDA attention kernels take, from the kernels' own table (CUDA-free, so a build without
  // CUDA answers too): the package refuses other pairs on CUDA tensors by name, before any collective.
  nb::list dims;
  for (const cuda::AttentionDims& d : cuda::kAttentionDims) dims.append(nb::make_tuple(d.qk, d.v));
  m.attr("cuda_attention_dims") = nb::tuple(dims);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  nb::class_<Row>(m, "Row")
      .def("__init__", [](Row* self, const std::vector<int64_t>& parents,
                          const std::vector<int64_t>& lengths) { new (self) Row(make_row(parents, lengths)); })
      .def_static("from_json", &row_from_json)
      .def("to_json", &row_to_json)
      .def_prop_ro("tokens", &Row::tokens)
      .def_prop_ro("num_segments", &Row::num_segments)
      .def_prop_ro("parents",
                   [](const Row& r) {
                     std::vector<int64_t> out;
                     for (const Segment& s : r.segments()) out.push_back(s.parent);
                     return out;
                   })
      .def_prop_ro("lengths",
                   [](const Row& r) {
                     std::vector<int64_t> out;
                     for (const Segment& s : r.segments()) out.push_back(s.length);
                     return out;
                   })
      .def_prop_ro("starts",
                   [](const Row& r) {
                     std::vector<int64_t> out;
                     for (int32_t s = 0; s < r.num_segments(); ++s) out.push_back(r.start(s));
                     return out;
                   })
      .def("leaves", &Row::leaves)
      .def("segment_of", &Row::segment_of)
      .def("positions", [](const Row& r) { return numpy_of(logical_positions(r)); })
      .def("visible", &Row::visible, nb::arg("query"), nb::arg("key"), nb::arg("window") = 0);

  nb::class_<Plan>(m, "Plan")
      .def_ro("cp", &Plan::cp)
      .def_prop_ro("layout", [](const Plan& p) { return std::string(layout_name(p.layout)); })
      .def_ro("window", &Plan::window)
      .def_ro("num_waves", &Plan::num_waves)
      .def_ro("visible_pairs", &Plan::visible_pairs)
      .def_ro("predicted_makespan_ms", &Plan::predicted_makespan_ms)
      .def("owned_ranges",
           [](const Plan& p, int rank) {
             require(rank >= 0 && rank < p.cp, "rank ", rank, " out of range for a plan of ", p.cp, " ranks");
             std::vector<std::tuple<int64_t, int64_t>> out;
             for (const TokenRange& t : p.ranks[static_cast<size_t>(rank)].owned) out.emplace_back(t.begin, t.end);
             return out;
           })
      .def("to_json", [](const Plan& p) { return json::dump(plan_to_json(p)); });

  m.def("layout_names", [] { return layout_names(); });
  m.def(
      "make_plan",
      [](const Row& row, int cp, const std::string& layout, int64_t window, const std::string& costs_path) {
        require(cp >= 1, "cp must be >= 1, got ", cp);
        const CostModel costs = costs_path.empty() ? CostModel{} : load_costs(costs_path);
        PlanOptions options;
        options.layout = parse_layout(layout);
        // The layer planned for: DESIGN.md's benchmark shape (the Python API passes no head dims yet), its window.
        AttentionShape shape;
        shape.window = window;
        return make_plan(row, cp, shape, costs, options);
      },
      nb::arg("row"), nb::arg("cp"), nb::arg("layout") = "searched", nb::arg("window") = 0,
      nb::arg("costs_path") = "");

  m.def(
      "plan_for_ownership",
      [](const Row& row, const Plan& ownership, int64_t window, const std::string& costs_path) {
        const CostModel costs = costs_path.empty() ? CostModel{} : load_costs(costs_path);
        AttentionShape shape;
        shape.window = window;
        return plan_for_ownership(row, ownership, shape, costs);
      },
      nb::arg("row"), nb::arg("ownership"), nb::arg("window") = 0, nb::arg("costs_path") = "");

  nb::class_<Communicator>(m, "Communicator")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size);

#if TREECP_HAVE_CUDA && TREECP_HAVE_NCCL
  // Bootstrap over a torch group (treecp.torch._comm): rank 0 makes the id, the group broadcasts it, every
  // rank joins; joining waits for the others, so it runs without the GIL.
  m.def("nccl_unique_id", [] {
    const NcclUniqueId id = make_nccl_unique_id();
    return nb::bytes(id.bytes.data(), id.bytes.size());
  });
  nb::class_<NcclCommunicator, Communicator>(m, "NcclCommunicator")
      .def(
          "__init__",
          [](NcclCommunicator* self, nb::bytes id, int rank, int size, int device) {
            NcclUniqueId uid;
            require(id.size() == uid.bytes.size(), "NCCL communicator: the unique id has ", id.size(),
                    " bytes, expected ", uid.bytes.size());
            std::memcpy(uid.bytes.data(), id.c_str(), uid.bytes.size());
            nb::gil_scoped_release released;
            new (self) NcclCommunicator(uid, rank, size, device);
          },
          nb::arg("unique_id"), nb::arg("rank"), nb::arg("size"), nb::arg("device"))
      .def_prop_ro("device", &NcclCommunicator::device);
#endif

  auto key = nb::class_<py::KeyCore>(m, "KeyCore");
  key.def("__init__",
          [](py::KeyCore* self, const Row& row, const Plan& plan, int rank, int size, nb::object comm) {
            std::unique_ptr<Communicator> c = comm.is_none() ? make_self_communicator()
                                                             : py::make_python_communicator(rank, size, comm);
            new (self) py::KeyCore(row, plan, std::move(c));
          },
          nb::arg("row"), nb::arg("plan"), nb::arg("rank"), nb::arg("size"), nb::arg("comm").none())
      .def_prop_ro("rank", &py::KeyCore::rank)
      .def_prop_ro("cp", &py::KeyCore::cp)
      .def_prop_ro("owned_tokens", &py::KeyCore::owned_tokens)
      .def_prop_ro("fingerprint", [](const py::KeyCore& k) { return fingerprint(k.row(), k.plan()); })
      .def("owned_index", [](const py::KeyCore& k) { return numpy_of(k.owned_index()); })
      .def("owned_counts", [](const py::KeyCore& k) {
        std::vector<int64_t> out;
        for (int r = 0; r < k.cp(); ++r) out.push_back(k.plan().ranks[static_cast<size_t>(r)].owned_tokens());
        return out;
      });
  key.def("cuda_stream", &py::KeyCore::cuda_stream, Compute());
#if TREECP_HAVE_CUDA && TREECP_HAVE_NCCL
  // The key keeps the communicator alive (the package also caches it per group and device).
  key.def("use_nccl", &py::KeyCore::use_nccl, nb::arg("comm"), nb::keep_alive<1, 2>());
#endif
  key.def(
      "cuda_attention_forward",
      [](py::KeyCore& k, int hq, int hkv, int d, int dv, double scale, int device, bool fp16, uintptr_t q, uintptr_t kk,
         uintptr_t v, uintptr_t sink, uintptr_t y, uintptr_t lse, uintptr_t o_presink) {
        k.cuda_attention_forward({hq, hkv, d, dv, scale}, device, fp16, q, kk, v, sink, y, lse, o_presink);
      },
      Compute());
  key.def(
      "cuda_attention_backward",
      [](py::KeyCore& k, int hq, int hkv, int d, int dv, double scale, int device, bool fp16, uintptr_t q, uintptr_t kk,
         uintptr_t v, uintptr_t sink, uintptr_t o, uintptr_t lse, uintptr_t dy, uintptr_t dq, uintptr_t dk,
         uintptr_t dvv, uintptr_t dsink) {
        k.cuda_attention_backward({hq, hkv, d, dv, scale}, device, fp16, q, kk, v, sink, o, lse, dy, dq, dk, dvv,
                                  dsink);
      },
      Compute());
  key.def(
      "cuda_gdn_forward",
      [](py::KeyCore& k, int heads, int dk, int dv, bool per_channel, double scale, int chunk, int precision,
         bool fla_split, int device, bool fp16, uintptr_t q, uintptr_t kk, uintptr_t v, uintptr_t g, uintptr_t beta,
         uintptr_t y, bool keep) {
        k.cuda_gdn_forward({heads, dk, dv, per_channel, scale, chunk, precision, fla_split, keep}, device, fp16, q, kk,
                           v, g, beta, y);
      },
      Compute());
  key.def(
      "cuda_gdn_backward",
      [](py::KeyCore& k, int heads, int dk, int dv, bool per_channel, double scale, int chunk, int precision,
         bool fla_split, int device, bool fp16, uintptr_t q, uintptr_t kk, uintptr_t v, uintptr_t g, uintptr_t beta,
         uintptr_t dy, uintptr_t dq, uintptr_t dk_, uintptr_t dv_, uintptr_t dg, uintptr_t dbeta, bool keep) {
        k.cuda_gdn_backward({heads, dk, dv, per_channel, scale, chunk, precision, fla_split, keep}, device, fp16, q, kk,
                            v, g, beta, dy, dq, dk_, dv_, dg, dbeta);
      },
      Compute());
  // The runs GDN forwards with keep kept for their backward: the last one's id, dropping one by id, their count.
  key.def("last_gdn_saved", &py::KeyCore::last_gdn_saved);
  key.def("drop_gdn_saved", &py::KeyCore::drop_gdn_saved, nb::arg("id"));
  key.def("gdn_saved_count", &py::KeyCore::gdn_saved_count);
  key.def("cuda_conv_forward", &py::KeyCore::cuda_conv_forward, Compute());
  key.def("cuda_conv_backward", &py::KeyCore::cuda_conv_backward, Compute());
  bind_ops<float>(key);
  bind_ops<double>(key);
}
