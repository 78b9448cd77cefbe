"""seqpar.DsaCp against a dense DSA written in torch (indexer scores of every visible key, top-k,
softmax over the selected latents, KL indexer loss), forward and backward: out's gradient into q and c, the indexer
loss's into q_idx, k_idx and w, at every (ulysses_size, ring_size) of the world."""

import pytest
import torch

import seqpar
from references import dsa_reference, random_full, run_against_reference, usp_grids

B, S, H, DQK, DV, HI, DI, TOPK = 1, 48, 4, 16, 8, 2, 8, 8
WORLD = seqpar.world().size


def dsa_inputs():
    return [random_full((B, S, H, DQK)), random_full((B, S, DQK)), random_full((B, S, HI, DI)),
            random_full((B, S, DI)), random_full((B, S, HI))]


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("select,window", [("ring", 0), ("allgather", 0), ("ring", 12)], ids=str)
def test_dsa_fp64_matches_dense_reference(grid_shape, kind, select, window):
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, kind)
    dsa = seqpar.DsaCp(grid, layout, select=select, topk=TOPK, dim_v=DV, window=window)

    def layer(*inputs):
        out, loss = dsa(*inputs)
        return [out], [loss]

    def reference(*inputs):
        out, loss = dsa_reference(*inputs, topk=TOPK, dim_v=DV, window=window)
        return [out], [loss]

    run_against_reference(grid, layout, dsa_inputs(), [], layer, reference, 1e-10)


def test_dsa_fixed_loss_weight():
    """indexer_loss_weight: one pass, the indexer inputs get weight * d(loss), as the loss added with that weight."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    weight = 0.25  # a float in C++ (loss_grad_scale): exact
    dsa = seqpar.DsaCp(grid, layout, topk=TOPK, dim_v=DV, indexer_loss_weight=weight)

    torch.manual_seed(3)
    inputs = dsa_inputs()
    ref = [t.detach().clone().requires_grad_() for t in inputs]
    out_ref, loss_ref = dsa_reference(*ref, topk=TOPK, dim_v=DV)
    dout = torch.randn(out_ref.shape, dtype=torch.float64)
    ((out_ref * dout).sum() + weight * loss_ref).backward()
    pos = layout.positions(grid.cp_rank)
    local = [seqpar.shard_sequence(t, layout, grid.cp_rank) for t in inputs]
    (dsa(*local) * dout.index_select(1, pos)).sum().backward()
    for i, (t, r) in enumerate(zip(inputs, ref)):
        grad = t.grad.clone()
        grid.cp.all_reduce(grad)
        assert torch.allclose(grad, r.grad, rtol=0, atol=1e-10 * max(1.0, r.grad.abs().max().item())), f"input {i}"
