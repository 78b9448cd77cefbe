"""Activation checkpointing (torch.utils.checkpoint, non-reentrant, as torchtitan applies it per block) and
torch.compile around seqpar's layers: the same outputs and gradients as the plain block (bit for bit under
checkpointing; within 1e-12 in fp64 compiled), and no second (collective) forward of a seqpar layer in the
backward."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import seqpar

WORLD = seqpar.world().size


def _block(grid, layout):
    """A linear projection into MHA (with dropout, whose seed advances per forward) and GDN, fp64."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 3 * 2 * 8 + 3 * 2 * 8 + 4, dtype=torch.float64)
    attn = seqpar.MhaCp(grid, layout, dropout_p=0.5, dropout_seed=7)
    gdn = seqpar.GdnCp(grid, layout, chunk_size=4)

    def block(x):
        p = proj(x)
        q, k, v = (t.contiguous() for t in p[..., :48].view(1, -1, 3, 2, 8).unbind(2))
        gq, gk, gv = (t.contiguous() for t in p[..., 48:96].view(1, -1, 3, 2, 8).unbind(2))
        g = -torch.nn.functional.softplus(p[..., 96:98]).contiguous()
        beta = torch.sigmoid(p[..., 98:100]).contiguous()
        return attn(q, k, v).sum(-1) + gdn(gq, gk, gv, g, beta)[0].sum(-1)

    return proj, attn, block


@pytest.mark.parametrize("wrap", ["checkpoint", "compile"])
def test_wrapped_block_equals_plain(wrap):
    if wrap == "compile" and WORLD > 2:
        pytest.skip("torch.compile: checked at 1 and 2 ranks (its compile time is the cost, not seqpar's)")
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 24)
    x = seqpar.shard_sequence(torch.randn(1, 24, 16, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(1)), layout, grid.cp_rank)
    results = []
    for wrapped in (False, True):
        proj, attn, block = _block(grid, layout)
        f = block
        if wrapped:
            f = (lambda t: checkpoint(block, t, use_reentrant=False)) if wrap == "checkpoint" else torch.compile(block)
        out = f(x)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in proj.parameters()], attn._num_dropout_calls))
    (out0, grads0, calls0), (out1, grads1, calls1) = results
    if wrap == "checkpoint":
        assert torch.equal(out0, out1)
        assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    else:  # inductor fuses the block's own ops (softplus, the sums) in another order
        torch.testing.assert_close(out1, out0, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads1, grads0):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert calls0 == calls1 == 1  # the dropout seed advanced once: no forward of MhaCp ran again in the backward
