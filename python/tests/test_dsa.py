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


@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("weighted", [False, True], ids=["loss", "weighted"])
def test_dsa_returns_topk_indices(kind, weighted):
    """return_topk_indices=True: each local query's selection, as token indices of the row, is the dense reference's
    top-k set within its document (-1 where a query has fewer visible keys); a packed row of two documents, 19 + 28
    tokens, so that the layout pads inside the row and slot positions differ from token indices."""
    cu = [0, 19, 47]
    seq = cu[-1]
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.packed_for_grid(grid, cu, kind=kind)
    assert WORLD == 1 or layout.padded_len > seq
    weight = {"indexer_loss_weight": 0.5} if weighted else {}
    dsa = seqpar.DsaCp(grid, layout, topk=TOPK, dim_v=DV, return_topk_indices=True, **weight)
    torch.manual_seed(5)
    inputs = [random_full((B, seq) + t.shape[2:]) for t in dsa_inputs()]
    result = dsa(*(seqpar.shard_sequence(t.detach(), layout, grid.cp_rank) for t in inputs))
    assert len(result) == (2 if weighted else 3)
    topk = result[-1]
    assert topk.dtype == torch.int64 and not topk.requires_grad
    assert topk.shape == (B, layout.local_len, TOPK)
    q, c, q_idx, k_idx, w = (t.detach() for t in inputs)
    scores = (torch.einsum("bthd,bjd->bthj", q_idx, k_idx).relu() * w[..., None]).sum(2)
    doc = torch.bucketize(torch.arange(seq), torch.tensor(cu[1:]), right=True)
    t_idx, j_idx = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    visible = (j_idx <= t_idx) & (doc[:, None] == doc[None, :])
    order = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
    for row, token in enumerate(layout.token_index(grid.cp_rank).tolist()):
        got = topk[0, row].tolist()
        if token < 0:  # a padding row selects nothing
            assert got == [-1] * TOPK, f"padding row {row}: {got}"
            continue
        n = min(TOPK, int(visible[token].sum()))
        want = sorted(order[0, token, :n].tolist())
        assert sorted(x for x in got if x >= 0) == want and got.count(-1) == TOPK - n, (
            f"rank {grid.cp_rank} row {row} (token {token}): {got} != {want}")
