"""The C++ Communicator's collectives over a torch process group.

treecp's protocol code (C++) calls these through the extension with 1-D tensors that view its host
buffers; on CPU the group is gloo (or MPI), whose all_to_all_single with split sizes, all_reduce,
all_gather_into_tensor and point-to-point ops are what the protocol needs.
"""

from __future__ import annotations

import torch.distributed as dist


class GroupCommunicator:
    def __init__(self, group):
        self.group = group

    def all_to_all_v(self, send, send_counts, recv, recv_counts):
        dist.all_to_all_single(recv, send, list(recv_counts), list(send_counts), group=self.group)

    def all_reduce_sum(self, tensor):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_gather(self, send, recv):
        dist.all_gather_into_tensor(recv, send, group=self.group)

    def send_recv(self, ops):
        p2p = [
            dist.P2POp(dist.isend if is_send else dist.irecv, tensor, dist.get_global_rank(self.group, peer), self.group)
            for is_send, peer, tensor in ops
        ]
        if p2p:
            for work in dist.batch_isend_irecv(p2p):
                work.wait()

    def barrier(self):
        dist.barrier(group=self.group)
