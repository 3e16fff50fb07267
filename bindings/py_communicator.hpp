// A Communicator whose collectives call back into Python (torch.distributed over gloo in the package),
// so that the very same C++ protocol runs over a torch process group. Buffers cross as torch tensors
// that view the C++ memory for the duration of one call (DLPack, no copy).
#pragma once

#include <nanobind/nanobind.h>

#include <memory>

#include "comm/communicator.hpp"

namespace treecp::py {

// `impl` has the methods all_to_all_v(send, send_counts, recv, recv_counts), all_reduce_sum(t),
// all_gather(send, recv), send_recv([(is_send, peer, t), ...]) and barrier(); counts are in elements and
// `send`/`recv` are 1-D tensors packed peer after peer.
std::unique_ptr<Communicator> make_python_communicator(int rank, int size, nanobind::object impl);

}  // namespace treecp::py
