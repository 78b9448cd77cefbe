"""seqpar.UspAttention (ring p2p / all-gather, Ulysses, USP; layouts; window; GQA) against materialised softmax
attention on the whole sequence, forward and backward, at every (ulysses_size, ring_size) of the world."""

import pytest
import torch

import seqpar
from references import check_close, mha_reference, random_full, run_against_reference, usp_grids

B, S, HQ, HKV, D = 1, 48, 4, 2, 16
WORLD = seqpar.world().size

# (impl, causal, window): the window needs causal.
CONFIGS = [("p2p", True, 0), ("p2p", False, 0), ("p2p", True, 7), ("allgather", True, 0), ("allgather", True, 7)]
# Per-dtype tolerance, relative to max(1, max |reference|): fp64 runs fp64 end to end; fp32 rounds each product
# (2^-24) over 48 keys; bf16 / fp16 round the outputs and the incoming gradients to 8 / 11 bits.
RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 5e-3}


def run_mha(grid, layout, config, dtype):
    attn = seqpar.UspAttention(grid, layout, config)
    q = random_full((B, S, HQ, D), dtype)
    k = random_full((B, S, HKV, D), dtype)
    v = random_full((B, S, HKV, D), dtype)
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v, config.causal, config.window)], []),
                          RTOL[dtype])


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "stripe"])
@pytest.mark.parametrize("impl,causal,window", CONFIGS, ids=lambda x: str(x))
def test_usp_fp64_matches_reference(grid_shape, kind, impl, causal, window):
    grid = seqpar.SpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, kind)
    run_mha(grid, layout, seqpar.RingAttentionConfig(impl=impl, causal=causal, window=window), torch.float64)


# A packed row with a zero-length document and lengths no layout divides; an unpacked odd length.
CU_SEQLENS = [0, 5, 5, 22, 40, 53]
ODD_T = 197


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "balanced"])
@pytest.mark.parametrize("impl,causal,window", CONFIGS, ids=lambda x: str(x))
def test_usp_packed_row_matches_per_document_reference(grid_shape, kind, impl, causal, window):
    """Attention inside each document of a packed row (padded per the layout) against the fp64 materialised
    attention with a per-document mask, forward and backward."""
    grid = seqpar.SpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.packed_for_grid(grid, torch.tensor(CU_SEQLENS), kind)
    assert layout.is_packed and layout.seq_len == CU_SEQLENS[-1] and layout.padded_len % layout.num_ranks == 0
    assert layout.cu_seqlens.tolist() == CU_SEQLENS
    config = seqpar.RingAttentionConfig(impl=impl, causal=causal, window=window)
    attn = seqpar.UspAttention(grid, layout, config)
    T = CU_SEQLENS[-1]
    q, k, v = random_full((1, T, HQ, D)), random_full((1, T, HKV, D)), random_full((1, T, HKV, D))
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v, causal, window, cu_seqlens=CU_SEQLENS)], []),
                          RTOL[torch.float64])
    rope = layout.rope_positions(grid.sp_rank)
    tokens = layout.token_index(grid.sp_rank)
    starts = torch.tensor(CU_SEQLENS)
    doc = torch.bucketize(tokens.clamp(min=0), starts[1:], right=True)
    want = torch.where(tokens >= 0, tokens - starts.index_select(0, doc), 0)
    assert torch.equal(rope, want), "rope_positions are not the offsets inside the documents"


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "stripe"])
@pytest.mark.parametrize("impl", ["p2p", "allgather"])
def test_usp_padded_odd_length(grid_shape, kind, impl):
    """T = 197 tokens, padded to what the layout needs, against the fp64 reference on the 197 tokens."""
    grid = seqpar.SpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, ODD_T, kind)
    assert layout.seq_len == ODD_T and layout.padded_len >= ODD_T and not layout.is_packed
    attn = seqpar.UspAttention(grid, layout, seqpar.RingAttentionConfig(impl=impl, causal=True))
    q, k, v = random_full((B, ODD_T, HQ, D)), random_full((B, ODD_T, HKV, D)), random_full((B, ODD_T, HKV, D))
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v, True)], []), RTOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_usp_dtypes(dtype):
    grid = seqpar.SpGrid(1, *usp_grids(WORLD)[len(usp_grids(WORLD)) // 2])
    run_mha(grid, seqpar.SequenceLayout.for_grid(grid, S), seqpar.RingAttentionConfig(), dtype)


def test_lse_and_positions():
    """lse of the local rows (no gradient) and the layout's positions for RoPE."""
    grid = seqpar.SpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    attn = seqpar.UspAttention(grid, layout, causal=True)
    pos = layout.positions(grid.sp_rank)
    assert torch.equal(attn.layer.positions, pos) and pos.dtype == torch.int64 and len(pos) == layout.local_len
    everyone = seqpar.gather_sequence(grid, layout, pos.to(torch.float64)[None, :, None], seq_dim=1)
    assert torch.equal(everyone.flatten(), torch.arange(S, dtype=torch.float64)), "the pieces do not tile 0..S-1"
    q, k, v = (torch.randn(B, layout.local_len, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV))
    out, lse = attn(q, k, v, return_lse=True)
    assert lse.shape == (B, HQ, layout.local_len) and not lse.requires_grad
    qf, kf, vf = (seqpar.gather_sequence(grid, layout, t) for t in (q, k, v))
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf.repeat_interleave(2, 2)) / D**0.5
    ref_lse = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1)
    check_close("lse", lse, ref_lse.index_select(2, pos), 1e-12)


def test_errors_are_seqpar_errors_on_every_rank():
    grid = seqpar.SpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    attn = seqpar.UspAttention(grid, layout)
    q = torch.randn(B, layout.local_len, HQ, D, dtype=torch.float64)
    k = torch.randn(B, layout.local_len, HKV, D, dtype=torch.float64)
    with pytest.raises(seqpar.Error, match="not contiguous"):
        attn(q.transpose(1, 2), k, k)
    with pytest.raises(RuntimeError, match="dtype|fp32|fp64"):
        attn(q, k.float(), k)
    with pytest.raises(seqpar.Error, match="cu_seqlens"):
        seqpar.SequenceLayout.packed("zigzag", [0, 9, 4], 2)  # decreasing; arithmetic only: no communication
    with pytest.raises(seqpar.Error, match="not one of"):
        seqpar.RingAttentionConfig(impl="ringy")
    with pytest.raises(seqpar.Error):
        seqpar.SpGrid(1, 1, WORLD + 1)
