"""seqpar.shard_labels + seqpar.sharded_cross_entropy under torchrun (gloo) against the cross-entropy of the whole
sequence on one process: plain rows (zigzag with padding, contiguous) and a packed row of three documents, every
(ulysses_size, ring_size) of the world; the loss (the CP ranks' shares summed) and the logits' gradient (summed
over the CP group) within fp64 rounding. The reference shifts the labels document by document itself.

    torchrun --nproc-per-node 4 python/torch_tests/torchrun_loss.py   (PYTHONPATH: the build's python/)
"""

import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import seqpar

V, IGNORE = 11, -100


def reference_loss(logits, labels, cu_seqlens):
    """Mean next-token cross-entropy of the whole row(s): within each document, token t predicts token t + 1."""
    target = torch.full_like(labels, IGNORE)
    for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        target[:, lo:hi - 1] = labels[:, lo + 1:hi]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE)


def check(grid, layout, batch, cu_seqlens, label):
    torch.manual_seed(7)
    T = layout.seq_len
    logits = torch.randn(batch, T, V, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (batch, T))
    labels[:, 3] = IGNORE  # an unlabelled token inside the row
    ref = reference_loss(logits, labels, cu_seqlens)
    ref.backward()
    ref_grad = logits.grad.clone()
    logits.grad = None

    local_logits = seqpar.shard_sequence(logits, layout, grid.cp_rank)
    local_labels = seqpar.shard_labels(labels, layout, grid.cp_rank, ignore_index=IGNORE)
    loss = seqpar.sharded_cross_entropy(local_logits, local_labels, grid, ignore_index=IGNORE)
    loss.backward()
    total = loss.detach().clone().reshape(1)
    grid.cp.all_reduce(total)
    grad = logits.grad.clone()
    grid.cp.all_reduce(grad)
    scale = max(1.0, ref.abs().item())
    assert abs(total.item() - ref.item()) <= 1e-12 * scale, (f"rank {dist.get_rank()} {label}: loss {total.item()} "
                                                             f"vs {ref.item()}")
    err = (grad - ref_grad).abs().max().item()
    assert err <= 1e-12 * max(1.0, ref_grad.abs().max().item()), f"rank {dist.get_rank()} {label}: grad error {err}"
    if dist.get_rank() == 0:
        print(f"ok {label}: {grid}, loss {ref.item():.6f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    torch.set_num_threads(1)
    grids = [seqpar.torch_grid(process_group=dist.group.WORLD)]
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        grids.append(seqpar.torch_grid(device_mesh=mesh, ulysses_dim="ulysses", ring_dim="ring"))
    for grid in grids:
        for kind in ("zigzag", "contiguous"):
            layout = seqpar.SequenceLayout.for_grid(grid, 30, kind)  # 30 tokens: padding at 4 ranks
            check(grid, layout, 2, [0, 30], f"{kind}, 2 rows of 30")
            cu = [0, 7, 19, 30]
            packed = seqpar.SequenceLayout.packed_for_grid(grid, cu, kind)
            check(grid, packed, 1, cu, f"{kind}, packed row {cu}")
    # Bad shapes on one rank (its labels one row short) fail every rank alike, before anything waits on that rank.
    grid = grids[0]
    rows = seqpar.SequenceLayout.for_grid(grid, 30).local_len
    short = 1 if dist.get_rank() == world - 1 else 0
    try:
        seqpar.sharded_cross_entropy(torch.zeros(1, rows, 5), torch.zeros(1, rows - short, dtype=torch.int64), grid)
        raise AssertionError(f"rank {dist.get_rank()}: labels one row short on a rank were accepted")
    except seqpar.Error as e:
        assert "1 cp rank(s) have other shapes" in str(e), str(e)
    # shift_labels itself: the last token of every document gets no label.
    got = seqpar.shift_labels(torch.arange(8)[None], [0, 3, 3, 8])
    assert got.tolist() == [[1, 2, IGNORE, 4, 5, 6, 7, IGNORE]], got
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"torchrun_loss: all checks passed at {world} processes", flush=True)
    seqpar.distributed.clear_grid_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
