"""A rank that never joins: under torchrun (gloo), with SEQPAR_COMM_TIMEOUT_S=3, rank 0's forward fails after about
3 s with a seqpar.Error that names the group, the operation and the time waited (not a hang), and the group then
refuses further operations, naming the first failure. Rank 1 never calls the forward; it meets rank 0 afterwards
on the default group, which still works. With SEQPAR_AGREEMENT_CHECK=off the first message of the forward is the
ring's point-to-point step (a receive that gloo cannot cancel) instead of the agreement check's all-reduce over cp.

    SEQPAR_COMM_TIMEOUT_S=3 [SEQPAR_AGREEMENT_CHECK=off] torchrun --nproc-per-node 2 torchrun_timeout.py
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import seqpar


def main():
    assert os.environ.get("SEQPAR_COMM_TIMEOUT_S") == "3", "run with SEQPAR_COMM_TIMEOUT_S=3"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    group = dist.new_group([0, 1])
    grid = seqpar.torch_grid(process_group=group)
    layout = seqpar.SequenceLayout.for_grid(grid, 32)
    attn = seqpar.MhaCp(grid, layout)
    if rank == 0:
        q = torch.randn(1, layout.local_len, 2, 8)
        start = time.monotonic()
        try:
            attn(q, q, q)
            raise AssertionError("rank 0: the forward completed although rank 1 never joined")
        except seqpar.Error as e:
            waited = time.monotonic() - start
            text = str(e)
            print(f"rank 0 after {waited:.1f} s: {text}", flush=True)
            p2p = os.environ.get("SEQPAR_AGREEMENT_CHECK") == "off"
            expected = ("ring: batch_isend_irecv", "world rank 1 (ring rank 1)") if p2p else ("cp: all_reduce",
                                                                                            "world ranks 0-1")
            for fragment in expected + ("did not complete within 3 s", "torch.distributed"):
                assert fragment in text, f"'{fragment}' missing from: {text}"
            assert 2.5 < waited < 20, f"the timeout took {waited:.1f} s"
        try:
            grid.cp.barrier()
            raise AssertionError("rank 0: the group ran a barrier after a timed-out operation")
        except seqpar.Error as e:
            assert "not usable after an earlier failure" in str(e) and "did not complete" in str(e), str(e)
            print(f"rank 0, the next operation: {e}", flush=True)
    else:
        time.sleep(8)  # never joins the forward
    # The default group is another ProcessGroup: unaffected.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2.0
    if rank == 0:
        print("torchrun_timeout: passed", flush=True)
    sys.stdout.flush()
    os._exit(0)  # the abandoned collective of rank 0 is still pending in gloo: do not wait for it at exit


if __name__ == "__main__":
    main()
