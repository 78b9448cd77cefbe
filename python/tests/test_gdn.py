"""seqpar.GdnCp (chain / scan, Ulysses x ring, initial_state and final_state) and
seqpar.ShortConvCp against the token-by-token recurrence and torch's conv1d on the whole sequence,
forward and backward, at every (ulysses_size, ring_size) of the world."""

import pytest
import torch
import torch.nn.functional as F

import seqpar
from references import (gdn_packed_reference, gdn_reference, random_full, run_against_reference,
                        short_conv_reference, usp_grids)

B, S, HK, HV, K, V = 1, 48, 2, 4, 8, 8
WORLD = seqpar.world().size
# fp64 is fp64 end to end (chunked vs token-by-token summation orders differ by rounding only); fp32 adds 2^-24 per
# operation over 48 steps of a contracting recurrence.
RTOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def gdn_inputs(dtype, with_initial_state, T=S, num_states=B):
    q, k = random_full((B, T, HK, K), dtype), random_full((B, T, HK, K), dtype)
    v = random_full((B, T, HV, V), dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, dtype=torch.float64) + 2).to(dtype).requires_grad_()  # log decay < 0
    beta = torch.sigmoid(torch.randn(B, T, HV, dtype=torch.float64)).to(dtype).requires_grad_()
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    initial = random_full((num_states, HV, K, V), state_dtype, 0.5) if with_initial_state else None
    return [q, k, v, g, beta], [initial]


def run_gdn(grid, layout, config, dtype, with_initial_state):
    gdn = seqpar.GdnCp(grid, layout, config)
    sharded, replicated = gdn_inputs(dtype, with_initial_state, layout.seq_len)

    def layer(q, k, v, g, beta, initial_state):
        out, final_state = gdn(q, k, v, g, beta, initial_state)
        return [out], [final_state]

    def reference(q, k, v, g, beta, initial_state):
        out, final_state = gdn_reference(q, k, v, g, beta, initial_state, config.scale, config.use_qk_l2norm)
        return [out], [final_state]

    run_against_reference(grid, layout, sharded, replicated, layer, reference, RTOL[dtype])


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode", ["chain", "scan"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero_state", "initial_state"])
def test_gdn_fp64_matches_recurrence(grid_shape, kind, mode, with_initial_state):
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, kind)
    config = seqpar.GdnCpConfig(mode=mode, chunk_size=4)
    run_gdn(grid, layout, config, torch.float64, with_initial_state)


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode", ["chain", "scan"])
def test_gdn_padded_odd_length(grid_shape, kind, mode):
    """T = 53 tokens (padded as the layout needs) against the recurrence on the 53 tokens."""
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, 53, kind)
    run_gdn(grid, layout, seqpar.GdnCpConfig(mode=mode, chunk_size=4), torch.float64, True)


CU_SEQLENS = [0, 7, 7, 26, 41]  # a zero-length document; lengths no layout divides


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode", ["chain", "scan"])
def test_gdn_packed_per_document_states(grid_shape, kind, mode):
    """A packed row: each document runs from its own initial_state[d] and ends in final_state[d]
    ([N, Hv, K, V]), against the recurrence on each document alone."""
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.packed_for_grid(grid, CU_SEQLENS, kind)
    config = seqpar.GdnCpConfig(mode=mode, chunk_size=4)
    gdn = seqpar.GdnCp(grid, layout, config)
    sharded, replicated = gdn_inputs(torch.float64, True, CU_SEQLENS[-1], len(CU_SEQLENS) - 1)

    def layer(q, k, v, g, beta, initial_state):
        out, final_state = gdn(q, k, v, g, beta, initial_state)
        return [out], [final_state]

    def reference(q, k, v, g, beta, initial_state):
        out, final_state = gdn_packed_reference(q, k, v, g, beta, initial_state, CU_SEQLENS, config.scale,
                                                config.use_qk_l2norm)
        return [out], [final_state]

    run_against_reference(grid, layout, sharded, replicated, layer, reference, RTOL[torch.float64])


def test_gdn_fp32_without_l2norm():
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    run_gdn(grid, layout, seqpar.GdnCpConfig(use_qk_l2norm=False, scale=0.25), torch.float32, True)


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("width", [4, 20])  # 20 > S_local at 4 ranks: the halo spans several ranks
def test_short_conv_fp64_matches_conv1d(grid_shape, kind, width):
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, kind)
    conv = seqpar.ShortConvCp(grid, layout, channels=6, width=width, dtype=torch.float64)
    x = random_full((B, S, 6))
    run_against_reference(grid, layout, [x], [conv.weight], lambda x, w: ([seqpar.ShortConvFunction.apply(
        conv.layer, grid, x, w)], []), lambda x, w: ([short_conv_reference(x, w)], []), 1e-12)


def test_gdn_refuses_stripe():
    grid = seqpar.CpGrid(1, 1, WORLD)
    if WORLD == 1:
        pytest.skip("a ring of one holds one segment in any layout")
    with pytest.raises(seqpar.Error, match="stripe"):
        seqpar.GdnCp(grid, seqpar.SequenceLayout.for_grid(grid, S, "stripe"))


@pytest.mark.parametrize("mode", ["chain", "scan"])
def test_gdn_growing_state_is_the_recurrence(mode):
    """g > 0 (a growing state) and beta outside (0, 1) are not checked (docs/design.md, "The gated delta
    recurrence"): they must be computed as the recurrence is written, forward and backward, not silently otherwise."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    config = seqpar.GdnCpConfig(mode=mode, chunk_size=16)
    gdn = seqpar.GdnCp(grid, layout, config)
    torch.manual_seed(7)
    (q, k, v, _, _), (initial,) = gdn_inputs(torch.float64, True)
    g = (0.1 * torch.rand(B, S, HV, dtype=torch.float64)).requires_grad_()  # exp(g) in (1, 1.11]
    beta = (2 * torch.rand(B, S, HV, dtype=torch.float64)).requires_grad_()  # in (0, 2)

    def layer(q, k, v, g, beta, initial_state):
        out, final_state = gdn(q, k, v, g, beta, initial_state)
        return [out], [final_state]

    def reference(q, k, v, g, beta, initial_state):
        out, final_state = gdn_reference(q, k, v, g, beta, initial_state)
        return [out], [final_state]

    run_against_reference(grid, layout, [q, k, v, g, beta], [initial], layer, reference, RTOL[torch.float64])


def test_gdn_refuses_inputs_changed_in_place():
    """The layer keeps no copy of q, k, v, g, beta (autograd's inputs go back to its backward): an input changed in
    place between forward and backward is refused on every rank, naming it, as autograd refuses a saved tensor's."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 16)
    gdn = seqpar.GdnCp(grid, layout, chunk_size=4)
    local = layout.local_len
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, local, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(1, local, 2, 8, generator=gen, requires_grad=True)
    g = -torch.rand(1, local, 2, generator=gen)
    beta = torch.rand(1, local, 2, generator=gen)
    out, _ = gdn(q, k, v, g, beta)
    g.mul_(2)
    with pytest.raises(seqpar.Error, match="g was modified in place after the forward"):
        out.sum().backward()
    if WORLD > 1:  # on one rank only, after an agreed backward: that rank names the input, the others are told; no hang
        out, _ = gdn(q, k, v, g, beta)
        out.sum().backward()
        out, _ = gdn(q, k, v, g, beta)
        if grid.cp_rank == 0:
            beta.mul_(2)
        with pytest.raises(seqpar.Error, match="beta was modified" if grid.cp_rank == 0 else "another rank"):
            out.sum().backward()
