#include "py_communicator.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace nb = nanobind;

namespace treecp::py {
namespace {

nb::dlpack::dtype dlpack_type(CommType t) {
  switch (t) {
    case CommType::F32: return nb::dtype<float>();
    case CommType::F64: return nb::dtype<double>();
    case CommType::I64: return nb::dtype<int64_t>();
    case CommType::U8: return nb::dtype<uint8_t>();
    case CommType::BF16: return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  fail("communicator: unknown element type");
}

// A 1-D torch tensor over `count` elements at `data`, valid while the C++ caller's buffer is.
nb::object view(const void* data, int64_t count, CommType type) {
  const size_t shape[1] = {static_cast<size_t>(count)};
  nb::ndarray<nb::pytorch, nb::ndim<1>> a(const_cast<void*>(data), 1, shape, nb::handle(), nullptr,
                                          dlpack_type(type), nb::device::cpu::value);
  return nb::cast(a, nb::rv_policy::reference);
}

bool packed(const std::vector<int64_t>& counts, const std::vector<int64_t>& displs) {
  int64_t at = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (displs[p] != at) return false;
    at += counts[p];
  }
  return true;
}

int64_t total(const std::vector<int64_t>& counts) {
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  return n;
}

class PythonCommunicator final : public Communicator {
 public:
  PythonCommunicator(int rank, int size, nb::object impl) : rank_(rank), size_(size), impl_(std::move(impl)) {
    require(size >= 1 && rank >= 0 && rank < size, "communicator: rank ", rank, " out of range for ", size, " ranks");
  }
  ~PythonCommunicator() override {
    nb::gil_scoped_acquire gil;
    impl_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_to_all_v(const void* send, const std::vector<int64_t>& send_counts, const std::vector<int64_t>& send_displs,
                    void* recv, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_displs,
                    CommType type) override {
    const size_t n = static_cast<size_t>(size_);
    require(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n && recv_displs.size() == n,
            "all_to_all_v: one count and displacement per rank expected");
    const size_t es = comm_type_size(type);
    // torch's all_to_all_single takes split sizes of packed buffers; pack where the caller's are not.
    std::vector<unsigned char> send_pack, recv_pack;
    const void* s = send;
    void* r = recv;
    if (!packed(send_counts, send_displs)) {
      send_pack.resize(static_cast<size_t>(total(send_counts)) * es);
      size_t at = 0;
      for (size_t p = 0; p < n; ++p) {
        std::memcpy(send_pack.data() + at, static_cast<const unsigned char*>(send) + send_displs[p] * es,
                    static_cast<size_t>(send_counts[p]) * es);
        at += static_cast<size_t>(send_counts[p]) * es;
      }
      s = send_pack.data();
    }
    const bool recv_packed = packed(recv_counts, recv_displs);
    if (!recv_packed) {
      recv_pack.resize(static_cast<size_t>(total(recv_counts)) * es);
      r = recv_pack.data();
    }
    {
      nb::gil_scoped_acquire gil;
      invoke("all_to_all_v", view(s, total(send_counts), type), send_counts, view(r, total(recv_counts), type),
             recv_counts);
    }
    if (!recv_packed) {
      size_t at = 0;
      for (size_t p = 0; p < n; ++p) {
        std::memcpy(static_cast<unsigned char*>(recv) + recv_displs[p] * es, recv_pack.data() + at,
                    static_cast<size_t>(recv_counts[p]) * es);
        at += static_cast<size_t>(recv_counts[p]) * es;
      }
    }
  }

  void group_send_recv(const std::vector<P2POp>& ops, CommType type) override {
    nb::gil_scoped_acquire gil;
    nb::list list;
    for (const P2POp& op : ops) {
      require(op.peer >= 0 && op.peer < size_, "group_send_recv: peer ", op.peer, " out of range for ", size_,
              " ranks");
      list.append(nb::make_tuple(op.kind == P2POp::Kind::Send, op.peer, view(op.buffer, op.count, type)));
    }
    invoke("send_recv", list);
  }

  void all_reduce_sum(void* data, int64_t count, CommType type) override {
    nb::gil_scoped_acquire gil;
    invoke("all_reduce_sum", view(data, count, type));
  }

  void all_gather(const void* send, void* recv, int64_t count, CommType type) override {
    nb::gil_scoped_acquire gil;
    invoke("all_gather", view(send, count, type), view(recv, count * size_, type));
  }

  void barrier() override {
    nb::gil_scoped_acquire gil;
    invoke("barrier");
  }

 private:
  // The compute calls release the GIL (module.cpp), so every method takes it before touching Python.
  // A Python failure inside a collective becomes a treecp::Error naming the call, so that it travels
  // through the C++ runtime like any other and reaches Python as an exception.
  template <class... Args>
  void invoke(const char* name, Args&&... args) {
    try {
      impl_.attr(name)(std::forward<Args>(args)...);
    } catch (nb::python_error& e) {
      fail("communicator ", name, ": ", e.what());
    }
  }

  int rank_, size_;
  nb::object impl_;
};

}  // namespace

std::unique_ptr<Communicator> make_python_communicator(int rank, int size, nb::object impl) {
  return std::make_unique<PythonCommunicator>(rank, size, std::move(impl));
}

}  // namespace treecp::py
