"""seqpar.MhaCp's attention variants (softcap, ALiBi, sinks, dropout) against torch references on the whole sequence,
forward and backward, at every (ulysses_size, ring_size) of the world; seqpar.apply_rope on a sharded layout
against RoPE on the whole sequence."""

import math

import pytest
import torch

import seqpar
from references import check_close, random_full, run_against_reference, same_document, usp_grids

B, S, HQ, HKV, D = 2, 40, 4, 2, 8
WORLD = seqpar.world().size
RTOL = 1e-10  # fp64


def variant_reference(q, k, v, softcap=0.0, alibi_slopes=None, sinks=None, keep=None, p=0.0, cu_seqlens=None):
    """Causal softmax attention with the score modifiers (docs/design.md, "Score modifiers"): scores
    c tanh(s / c), then - slope_h |i - j|; a sink logit joins each row's softmax; keep [B, Hq, S, S] bool: dropout
    mask (kept pairs scaled by 1 / (1 - p))."""
    S_, Hq = q.shape[1], q.shape[2]
    rep = Hq // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[3])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(S_)[:, None], torch.arange(S_)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(s.dtype)[:, None, None] * (i - j).abs()
    visible = (j <= i) & same_document(S_, cu_seqlens)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(s.dtype)[None, :, None, None].expand(s.shape[0], Hq, S_, 1)
        prob = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
    else:
        prob = s.softmax(-1)
    if keep is not None:
        prob = prob * keep / (1 - p)
    return torch.einsum("bhij,bjhd->bihd", prob, v)


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("impl", ["p2p", "allgather"])
@pytest.mark.parametrize("variant", ["softcap", "alibi", "sinks", "all"])
def test_score_modifiers_match_reference(grid_shape, impl, variant):
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    softcap = 2.0 if variant in ("softcap", "all") else 0.0
    slopes = torch.tensor(seqpar.alibi_slopes(HQ)) if variant in ("alibi", "all") else None
    q, k, v = random_full((B, S, HQ, D)), random_full((B, S, HKV, D)), random_full((B, S, HKV, D))
    replicated = [random_full((HQ,))] if variant in ("sinks", "all") else []

    def layer(q, k, v, *sinks):
        attn = seqpar.MhaCp(grid, layout, impl=impl, softcap=softcap, alibi_slopes=slopes,
                            sinks=sinks[0] if sinks else None)
        return [attn(q, k, v)], []

    def reference(q, k, v, *sinks):
        return [variant_reference(q, k, v, softcap, slopes, sinks[0] if sinks else None)], []

    run_against_reference(grid, layout, [q, k, v], replicated, layer, reference, RTOL)


def test_alibi_slopes_are_press_et_al():
    """Powers of two: 2^(-8 (h+1) / H); otherwise those of the largest power of two below H, then every other slope
    of twice that."""
    assert seqpar.alibi_slopes(4) == pytest.approx([2 ** (-2 * (h + 1)) for h in range(4)])
    assert seqpar.alibi_slopes(6) == pytest.approx([2 ** (-2 * (h + 1)) for h in range(4)] + [2 ** -1, 2 ** -3])


def learned_sinks_move(grid, layout):
    """The sinks as a Parameter get a gradient and, updated in place by an optimizer, are seen by the next call."""
    sinks = torch.nn.Parameter(torch.zeros(HQ, dtype=torch.float64))
    attn = seqpar.MhaCp(grid, layout, sinks=sinks)
    q, k, v = (torch.randn(B, layout.local_len, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV))
    before = attn(q, k, v)
    before.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0
    with torch.no_grad():
        sinks.add_(5.0)  # in place, as an optimizer step: the layer's view sees it
    after = attn(q, k, v)
    return (after - before).abs().max().item()


def test_learned_sinks():
    grid = seqpar.CpGrid(1, 1, WORLD)
    assert learned_sinks_move(grid, seqpar.SequenceLayout.for_grid(grid, S)) > 1e-3


# ---- dropout ----------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul_hi_lo(a, m):
    """(a * m) >> 32 and (a * m) mod 2^32 for a < 2^32 (int64 tensor) and a 32-bit constant m, without overflow."""
    lo16, hi16 = m & 0xFFFF, m >> 16
    x, y = a * lo16, a * hi16  # each < 2^48
    low = (y & 0xFFFF) * 65536 + x
    return (y >> 16) + (low >> 32), low & _M32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 (Salmon et al. 2011) on int64 tensors holding 32-bit words."""
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        hi0, lo0 = _mul_hi_lo(c0, 0xD2511F53)
        hi1, lo1 = _mul_hi_lo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def test_philox_known_answers():
    """Random123's kat_vectors (the same as the C++ unit test)."""
    t = lambda *w: [torch.tensor(x, dtype=torch.int64) for x in w]  # noqa: E731
    got = philox4x32_10(*t(0, 0, 0, 0), *t(0, 0))
    assert [int(x) for x in got] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    got = philox4x32_10(*t(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), *t(0xA4093822, 0x299F31D0))
    assert [int(x) for x in got] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def dropout_keep(seed, p, batch, heads, seq_len):
    """[B, Hq, S, S] bool: the pairs attention/dropout.h keeps (docs/design.md, "Attention dropout"): word
    k_pos mod 4 of Philox(counter (k_pos / 4, q_pos, h, b), key (seed lo, seed hi)) >= ceil(p 2^32)."""
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    i = torch.arange(seq_len)[None, None, :, None]
    j = torch.arange(seq_len)[None, None, None, :]
    shape = (batch, heads, seq_len, seq_len)
    words = philox4x32_10(*(x.expand(shape) for x in (j >> 2, i, h, b)),
                          torch.tensor(seed & _M32), torch.tensor(seed >> 32))
    word = torch.stack(words, -1).gather(-1, (j & 3).expand(shape)[..., None])[..., 0]
    return word >= math.ceil(p * 2 ** 32)


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("impl", ["p2p", "allgather"])
def test_dropout_matches_philox_mask_reference(grid_shape, kind, impl):
    """Training-mode dropout: forward and backward equal the reference whose mask is Philox of the global pairs,
    computed here in torch (independent of the C++ generator)."""
    p, seed = 0.3, 1234567890123
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, kind)
    keep = dropout_keep(seed, p, B, HQ, S)
    assert 0.6 < keep.double().mean() < 0.8
    q, k, v = random_full((B, S, HQ, D)), random_full((B, S, HKV, D)), random_full((B, S, HKV, D))
    attn = seqpar.MhaCp(grid, layout, impl=impl, dropout_p=p, dropout_seed=seed)
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([variant_reference(q, k, v, keep=keep, p=p)], []), RTOL)


def test_dropout_seed_advances_in_training_and_is_off_in_eval():
    """The n-th training forward uses dropout_seed + n (equal to a fresh layer made with that seed); eval() is the
    layer without dropout; CP equals one rank (a grid of dp_size = world, cp_size 1) at the same seed."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    single = seqpar.CpGrid(WORLD, 1, 1)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    one = seqpar.SequenceLayout.for_grid(single, S)
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, S, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV))
    local = [seqpar.shard_sequence(t, layout, grid.cp_rank) for t in (q, k, v)]
    attn = seqpar.MhaCp(grid, layout, dropout_p=0.25, dropout_seed=7)
    first, second = attn(*local), attn(*local)
    again = seqpar.MhaCp(grid, layout, dropout_p=0.25, dropout_seed=8)(*local)
    check_close("second call vs seed + 1", second, again, RTOL)
    assert (first - second).abs().max() > 1e-3
    ref = seqpar.MhaCp(single, one, dropout_p=0.25, dropout_seed=7)(q, k, v)
    check_close("CP vs one rank", seqpar.gather_sequence(grid, layout, first), ref, RTOL)
    attn.eval()
    plain = seqpar.MhaCp(grid, layout)(*local)
    check_close("eval", attn(*local), plain, 0.0)


# ---- RoPE ---------------------------------------------------------------------------------------------------------


def rope_full(x, base=10000.0):
    """RoPE on the whole sequence (rotate-half form, as Llama's), positions 0..S-1."""
    S_, D_ = x.shape[1], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, D_, 2, dtype=torch.float64) / D_)
    ang = torch.arange(S_, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[None, :, None], torch.cat([ang.sin()] * 2, -1)[None, :, None]
    x1, x2 = x[..., : D_ // 2], x[..., D_ // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "stripe"])
def test_rope_on_shard_matches_full(kind):
    """apply_rope on this rank's rows (positions from the layout) = RoPE on the whole sequence, then sharded;
    on a packed row the positions restart in every document."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 37, kind)
    x = torch.randn(B, 37, HQ, D, dtype=torch.float64)
    got = seqpar.apply_rope(seqpar.shard_sequence(x, layout, grid.cp_rank), layout, grid.cp_rank)
    want = seqpar.shard_sequence(rope_full(x), layout, grid.cp_rank)
    check_close("rope", got, want, RTOL)
    cu = [0, 10, 30, 37]
    packed = seqpar.SequenceLayout.packed_for_grid(grid, cu, kind if kind != "stripe" else "zigzag")
    x1 = x[:1]
    want = torch.cat([rope_full(x1[:, a:b]) for a, b in zip(cu[:-1], cu[1:])], 1)
    got = seqpar.apply_rope(seqpar.shard_sequence(x1, packed, grid.cp_rank), packed, grid.cp_rank)
    check_close("rope packed", got, seqpar.shard_sequence(want, packed, grid.cp_rank), RTOL)
