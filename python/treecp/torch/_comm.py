"""The C++ Communicator's collectives over a torch process group, and the NCCL communicator made from one.

On CPU, treecp's protocol code (C++) calls GroupCommunicator through the extension with 1-D tensors that
view its host buffers; the group is gloo (or MPI), whose all_to_all_single with split sizes, all_reduce,
all_gather_into_tensor and point-to-point ops are what the protocol needs. On CUDA the protocol moves
device buffers on its own streams, so it talks NCCL directly: nccl_communicator() bootstraps one from the
group (rank 0's unique id, broadcast over the group) once per group and device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _core

# (process group, CUDA device index) -> treecp._core.NcclCommunicator, made once and shared by every key
# of that group on that device.
_NCCL: dict = {}


def collective_device(group) -> torch.device:
    """Where the package's own small collectives (agreements, fingerprints) put their tensors for `group`:
    the current CUDA device for an NCCL-only group, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nccl_communicator(group, device: torch.device):
    """The NCCL communicator of `group` on CUDA `device`; the first call on each rank of the group makes it
    (a broadcast over the group, then NCCL's own initialisation), so every rank must reach it."""
    slot = (group, device.index)
    comm = _NCCL.get(slot)
    if comm is None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        uid = [_core.nccl_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(uid, src=dist.get_global_rank(group, 0), group=group,
                                   device=collective_device(group))
        comm = _NCCL[slot] = _core.NcclCommunicator(uid[0], rank, size, device.index)
    return comm


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
