"""The torch.distributed communicator and device buffers, on a CPU machine under torchrun (gloo): a device buffer
(a fake CUDA address, never read) is refused on every rank before any message, naming the backend and the rule
(device buffers need nccl); the group then still runs host operations in step (nothing was left posted), with the
results of closed forms. Device buffers on nccl pass to the group as they are (compiled, never run on a GPU).

    torchrun --nproc-per-node 2 torchrun_device_buffers.py
"""

import datetime
import gc
import re

import torch
import torch.distributed as dist

import seqpar


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    grid = seqpar.torch_grid(process_group=dist.group.WORLD)
    for comm in (grid.ring, grid.cp):
        before = torch.zeros(1)
        try:
            comm._all_reduce_fake_device_buffer(0)
            raise AssertionError(f"rank {rank}: a device buffer was taken by a gloo group")
        except seqpar.Error as e:
            text = str(e)
        rule = (r"all_reduce.*: the torch.distributed backend gloo takes host buffers only; got the device buffer "
                r"fp32\[4\]@cuda:0 \(device buffers need a ProcessGroup whose backend takes CUDA tensors: nccl\)")
        assert re.search(rule, text), f"rank {rank}: {text}"
        # every rank refused: the sum of ones over the group is its size (a host all-reduce right after the refusal,
        # which would pair with a message left over from it otherwise)
        before += 1
        comm.all_reduce(before)
        assert before.item() == comm.size, f"rank {rank}: {before.item()} != {comm.size}"
    # host buffers as before: each rank's rank, summed
    t = torch.full((3,), float(rank))
    grid.cp.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(size * (size - 1) // 2))), t
    print(f"rank {rank}: device buffer refused on gloo; host operations unchanged", flush=True)
    del grid, comm  # they hold the group: dropped before it goes (docs/python.md)
    seqpar.distributed.clear_grid_cache()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
