#include "runtime/span_gather.hpp"

#include <string>

#include "core/error.hpp"
#include "core/json.hpp"

namespace treecp {

std::vector<Span> gather_spans(Communicator& comm, const std::vector<Span>& mine, int root) {
  const int n = comm.size(), me = comm.rank();
  require(root >= 0 && root < n, "gather_spans: root ", root, " outside [0, ", n, ")");
  // The spans travel as JSON text: [[name, category, track, begin_ms, end_ms], ...] (doubles exact).
  json::Value list = json::Value::array();
  for (const Span& s : mine) {
    json::Value v = json::Value::array();
    v.push_back(s.name);
    v.push_back(s.category);
    v.push_back(s.track);
    v.push_back(s.begin_ms);
    v.push_back(s.end_ms);
    list.push_back(v);
  }
  const std::string text = json::dump(list);
  const int64_t size = static_cast<int64_t>(text.size());
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  comm.all_gather(&size, sizes.data(), 1, CommType::I64);
  std::vector<int64_t> send_counts(static_cast<size_t>(n), 0), send_displs(static_cast<size_t>(n), 0),
      recv_counts(static_cast<size_t>(n), 0), recv_displs(static_cast<size_t>(n), 0);
  send_counts[static_cast<size_t>(root)] = size;
  int64_t total = 0;
  if (me == root) {
    for (int p = 0; p < n; ++p) {
      recv_displs[static_cast<size_t>(p)] = total;
      recv_counts[static_cast<size_t>(p)] = sizes[static_cast<size_t>(p)];
      total += sizes[static_cast<size_t>(p)];
    }
  }
  std::string all(static_cast<size_t>(total), '\0');
  comm.all_to_all_v(text.data(), send_counts, send_displs, all.data(), recv_counts, recv_displs, CommType::U8);
  std::vector<Span> out;
  if (me != root) return out;
  for (int p = 0; p < n; ++p) {
    const json::Value v = json::parse(std::string_view(all).substr(static_cast<size_t>(recv_displs[static_cast<size_t>(p)]),
                                                                   static_cast<size_t>(sizes[static_cast<size_t>(p)])));
    for (const json::Value& s : v.as_array("spans")) {
      const auto& f = s.as_array("span");
      require(f.size() == 5, "gather_spans: malformed span from rank ", p);
      out.push_back({f[0].as_string("name"), f[1].as_string("category"), p, static_cast<int>(f[2].as_int("track")),
                     f[3].as_double("begin_ms"), f[4].as_double("end_ms")});
    }
  }
  return out;
}

}  // namespace treecp
