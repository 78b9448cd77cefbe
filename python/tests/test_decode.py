"""seqpar.MhaDecodeCp, DsaDecodeCp and GdnDecodeCp (prefill under CP, extend, decode steps with sharded caches)
against the unsharded fp64 reference over the whole sequence (prompt, chunk and every decoded token at once), at
every (ulysses_size, ring_size) of the world."""

import pytest
import torch

import seqpar
from references import check_close, dsa_reference, gdn_reference, mha_reference, short_conv_reference, usp_grids

WORLD = seqpar.world().size
RTOL = 1e-10  # fp64 end to end


def rows_of(full, layout, cp_rank):
    """The reference's rows at this rank's real tokens, and the local row indices that hold them."""
    tokens = layout.token_index(cp_rank)
    real = (tokens >= 0).nonzero().flatten()
    return real, full.index_select(1, tokens.index_select(0, real))


def check_rows(name, local, full_ref, layout, cp_rank, offset=0):
    real, want = rows_of(full_ref.narrow(1, offset, layout.seq_len), layout, cp_rank)
    if real.numel() > 0:  # a short chunk can leave a rank with padding rows only
        check_close(name, local.index_select(1, real), want, RTOL)


# The prompt (odd: padded rows), a chunk, then steps of 1, 1 and 2 tokens.
T, CHUNK, STEPS = 23, 9, [1, 1, 2]
TOTAL = T + CHUNK + sum(STEPS)


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("shard,interleave", [("interleave", 1), ("interleave", 4), ("contiguous", 1)], ids=str)
@pytest.mark.parametrize("mode", ["pass-kv", "pass-q"])
def test_mha_prefill_extend_decode(grid_shape, kind, shard, interleave, mode):
    B, HQ, HKV, D = 2, 4, 2, 8
    grid = seqpar.CpGrid(1, *grid_shape)
    q, k, v = (torch.randn(B, TOTAL, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV))
    ref = mha_reference(q, k, v, causal=True)
    dec = seqpar.MhaDecodeCp(grid, shard=shard, interleave=interleave)
    cache = dec.make_cache(B, TOTAL, HKV, D, torch.float64)
    r = grid.cp_rank

    prompt = seqpar.SequenceLayout.for_grid(grid, T, kind)
    out, lse = dec.prefill(cache, prompt, *(seqpar.shard_sequence(t[:, :T], prompt, r) for t in (q, k, v)))
    check_rows("prefill out", out, ref, prompt, r)
    assert cache.length == T and lse.shape == (B, HQ, prompt.local_len)

    chunk = seqpar.SequenceLayout.for_grid(grid, CHUNK, kind)
    out, _ = dec.extend(cache, chunk, *(seqpar.shard_sequence(t[:, T:T + CHUNK], chunk, r) for t in (q, k, v)),
                        mode=mode)
    check_rows("extend out", out, ref, chunk, r, offset=T)
    assert cache.length == T + CHUNK

    pos = T + CHUNK
    for n in STEPS:
        out, lse = dec.decode(cache, q[:, pos:pos + n], k[:, pos:pos + n], v[:, pos:pos + n])
        check_close(f"decode out at {pos}", out, ref[:, pos:pos + n], RTOL)
        assert lse.shape == (B, HQ, n)
        pos += n
    assert cache.length == TOTAL and cache.num_steps == len(STEPS)


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
def test_mha_bf16_cache_as_the_docs_make_it(grid_shape):
    """docs/python.md's decode example makes a bf16 cache: prefill, extend and decode steps on bf16 tensors under CP
    against the fp64 reference of the same (bf16-rounded) inputs, within bf16's rounding of the outputs (fp32
    accumulators: one rounding of each output, 2^-8 relative, and of the partials the ranks merge)."""
    B, HQ, HKV, D = 1, 4, 2, 8
    grid = seqpar.CpGrid(1, *grid_shape)
    q, k, v = (torch.randn(B, TOTAL, h, D, dtype=torch.float64).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    ref = mha_reference(*(t.to(torch.float64) for t in (q, k, v)), causal=True)
    dec = seqpar.MhaDecodeCp(grid, shard="interleave", interleave=1)
    cache = dec.make_cache(batch=B, capacity=TOTAL, kv_heads=HKV, head_dim=D, dtype=torch.bfloat16)
    r, tol = grid.cp_rank, 2.0 ** -6

    prompt = seqpar.SequenceLayout.for_grid(grid, T)
    out, lse = dec.prefill(cache, prompt, *(seqpar.shard_sequence(t[:, :T], prompt, r) for t in (q, k, v)))
    assert out.dtype == torch.bfloat16
    real, want = rows_of(ref.narrow(1, 0, T), prompt, r)
    if real.numel() > 0:
        check_close("bf16 prefill out", out.index_select(1, real), want, tol)
    chunk = seqpar.SequenceLayout.for_grid(grid, CHUNK)
    out, _ = dec.extend(cache, chunk, *(seqpar.shard_sequence(t[:, T:T + CHUNK], chunk, r) for t in (q, k, v)))
    real, want = rows_of(ref.narrow(1, T, CHUNK), chunk, r)
    if real.numel() > 0:
        check_close("bf16 extend out", out.index_select(1, real), want, tol)
    pos = T + CHUNK
    for n in STEPS:
        out, _ = dec.decode(cache, q[:, pos:pos + n], k[:, pos:pos + n], v[:, pos:pos + n])
        check_close(f"bf16 decode out at {pos}", out, ref[:, pos:pos + n], tol)
        pos += n
    assert cache.length == TOTAL


def prefilled_mha(grid, hq, hkv, prompt, dim=8):
    """q, k, v of prompt + 1 tokens (fp64, batch 1), their causal fp64 reference, and an MhaDecodeCp with a cache of
    prompt + 1 tokens holding the prompt."""
    q, k, v = (torch.randn(1, prompt + 1, h, dim, dtype=torch.float64) for h in (hq, hkv, hkv))
    ref = mha_reference(q, k, v, causal=True)
    dec = seqpar.MhaDecodeCp(grid)
    cache = dec.make_cache(1, prompt + 1, hkv, dim, torch.float64)
    layout = seqpar.SequenceLayout.for_grid(grid, prompt)
    dec.prefill(cache, layout, *(seqpar.shard_sequence(t[:, :prompt], layout, grid.cp_rank) for t in (q, k, v)))
    return q, k, v, ref, dec, cache


def test_mha_decode_own_heads_and_refusals():
    """all_heads=False returns this rank's Hq / ulysses_size heads from q_head_offset; a step past the capacity is
    refused on every rank with the cache unchanged."""
    HQ, P = 4, 6
    grid = seqpar.CpGrid(1, WORLD if HQ % WORLD == 0 else 1, 1 if HQ % WORLD == 0 else WORLD)
    q, k, v, ref, dec, cache = prefilled_mha(grid, HQ, 4, P)
    out, _ = dec.decode(cache, q[:, P:], k[:, P:], v[:, P:], all_heads=False)
    h0, hl = dec.q_head_offset(HQ), HQ // grid.ulysses_size
    check_close("own heads", out, ref[:, P:, h0:h0 + hl], RTOL)
    with pytest.raises(seqpar.Error, match="capacity"):
        dec.decode(cache, q[:, P:], k[:, P:], v[:, P:])
    assert cache.length == P + 1


@pytest.mark.skipif(WORLD == 1, reason="one rank cannot disagree with itself")
def test_decode_all_heads_differing_across_ranks_fails_everywhere():
    """all_heads on one rank only (a Python-side option the C++ layer never sees) stops every rank with seqpar.Error
    naming it, before the step; the cache is unchanged and the next agreed step matches the fp64 reference."""
    B, P = 1, 6
    grid = seqpar.CpGrid(1, WORLD, 1)  # Ulysses over the world: all_heads gathers the heads
    q, k, v, ref, dec, cache = prefilled_mha(grid, 2 * WORLD, WORLD, P)
    with pytest.raises(seqpar.Error, match="all_heads"):
        dec.decode(cache, q[:, P:], k[:, P:], v[:, P:], all_heads=grid.cp_rank != 0)
    assert cache.length == P
    out, _ = dec.decode(cache, q[:, P:], k[:, P:], v[:, P:])
    check_close("step after the refusal", out, ref[:, P:], RTOL)
    gdn = seqpar.GdnDecodeCp(grid, value_heads=2 * WORLD, key_heads=WORLD)
    gcache = gdn.make_cache(B, 4, 4, torch.float64)
    x = [torch.randn(B, 1, h, 4, dtype=torch.float64) for h in (WORLD, WORLD, 2 * WORLD)]
    g, beta = -torch.rand(B, 1, 2 * WORLD, dtype=torch.float64), torch.rand(B, 1, 2 * WORLD, dtype=torch.float64)
    with pytest.raises(seqpar.Error, match="all_heads"):
        gdn.decode(gcache, *x, g, beta, all_heads=grid.cp_rank == 0)
    assert gcache.length == 0


DSA_H, DSA_DQK, DSA_DV, DSA_HI, DSA_DI, DSA_TOPK = 4, 16, 8, 2, 8, 8


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("shard,interleave", [("interleave", 1), ("interleave", 4), ("contiguous", 1)], ids=str)
def test_dsa_prefill_decode(grid_shape, kind, shard, interleave):
    B, total = 1, T + sum(STEPS)
    grid = seqpar.CpGrid(1, *grid_shape)
    inputs = [torch.randn(B, total, *s, dtype=torch.float64)
              for s in ((DSA_H, DSA_DQK), (DSA_DQK,), (DSA_HI, DSA_DI), (DSA_DI,), (DSA_HI,))]
    ref, _ = dsa_reference(*inputs, topk=DSA_TOPK, dim_v=DSA_DV)
    dec = seqpar.DsaDecodeCp(grid, shard=shard, interleave=interleave, topk=DSA_TOPK, dim_v=DSA_DV)
    cache = dec.make_cache(B, total, DSA_DI, DSA_DQK, torch.float64)
    prompt = seqpar.SequenceLayout.for_grid(grid, T, kind)
    out, _, topk = dec.prefill(cache, prompt, *(seqpar.shard_sequence(t[:, :T], prompt, grid.cp_rank)
                                                for t in inputs))
    check_rows("dsa prefill out", out, ref, prompt, grid.cp_rank)
    pos = T
    for n in STEPS:
        out, _, topk = dec.decode(cache, *(t[:, pos:pos + n] for t in inputs))
        check_close(f"dsa decode out at {pos}", out, ref[:, pos:pos + n], RTOL)
        assert topk.shape == (B, n, DSA_TOPK) and int(topk.max()) < pos + n
        pos += n
    assert cache.length == total


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("conv_width", [0, 4])
def test_gdn_prefill_decode(grid_shape, kind, conv_width):
    """Prefill under CP then decode steps, with and without the short conv (q, k, v are then the conv's inputs),
    against the fp64 conv + token-by-token recurrence over the whole sequence."""
    B, HK, HV, K, V = 1, 4, 8, 8, 8
    total = T + sum(STEPS)
    grid = seqpar.CpGrid(1, *grid_shape)
    q, k = (torch.randn(B, total, HK, K, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, total, HV, V, dtype=torch.float64)
    g = -torch.rand(B, total, HV, dtype=torch.float64)
    beta = torch.rand(B, total, HV, dtype=torch.float64)
    C = 2 * HK * K + HV * V
    weight = torch.randn(C, conv_width, dtype=torch.float64) * 0.5 if conv_width else None
    if weight is not None:
        x = short_conv_reference(torch.cat([t.flatten(2) for t in (q, k, v)], 2), weight)
        rq, rk, rv = x.split([HK * K, HK * K, HV * V], 2)
        rq, rk, rv = rq.unflatten(2, (HK, K)), rk.unflatten(2, (HK, K)), rv.unflatten(2, (HV, V))
    else:
        rq, rk, rv = q, k, v
    ref, ref_state = gdn_reference(rq, rk, rv, g, beta)

    dec = seqpar.GdnDecodeCp(grid, value_heads=HV, key_heads=HK)
    cache = dec.make_cache(B, K, V, torch.float64, conv_width=conv_width)
    prompt = seqpar.SequenceLayout.for_grid(grid, T, kind)
    out = dec.prefill(cache, prompt, *(seqpar.shard_sequence(t[:, :T], prompt, grid.cp_rank)
                                       for t in (q, k, v, g, beta)), conv_weight=weight)
    check_rows("gdn prefill out", out, ref, prompt, grid.cp_rank)
    assert cache.length == T
    pos = T
    for n in STEPS:
        out = dec.decode(cache, *(t[:, pos:pos + n] for t in (q, k, v, g, beta)), conv_weight=weight)
        check_close(f"gdn decode out at {pos}", out, ref[:, pos:pos + n], RTOL)
        pos += n
    h0, hl = dec.head_offset, HV // grid.cp.size
    check_close("gdn state of this rank's heads", cache.state, ref_state[:, h0:h0 + hl], RTOL)
    assert cache.length == total
