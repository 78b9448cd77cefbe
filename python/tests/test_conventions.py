"""The conventions docs/python.md, "Coming from flash-attn, flash-linear-attention or YunChang", states against those
libraries: the defaults a ported call meets (MhaCp causal, GdnCp with the l2 norm of q and k), the window's meaning,
lse's shape, and the zigzag split. Each against torch written from the other library's convention, fp64, the whole
sequence on every rank, at any world size (a ring over the world)."""

import pytest
import torch

import seqpar

WORLD = seqpar.world().size
S, H, D, W = 64, 2, 16, 8


def _grid_layout():
    grid = seqpar.CpGrid(1, 1, WORLD)
    return grid, seqpar.SequenceLayout.for_grid(grid, S)


def _attention(q, k, v, mask):
    """Softmax attention over [B, S, H, D] with scale 1 / sqrt(D); returns out [B, S, H, D], lse [B, H, S]."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), torch.logsumexp(s, -1)


def _qkv():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(1, S, H, D, dtype=torch.float64, generator=g) for _ in range(3)]


def _run_mha(grid, layout, qkv, **kwargs):
    out, lse = seqpar.MhaCp(grid, layout, **kwargs)(
        *(seqpar.shard_sequence(t, layout, grid.cp_rank) for t in qkv), return_lse=True)
    assert tuple(lse.shape) == (1, H, layout.local_len)  # [B, Hq, S_local], as flash-attn's softmax_lse
    return seqpar.gather_sequence(grid, layout, out), seqpar.gather_sequence(grid, layout, lse, seq_dim=2)


def test_mha_default_is_causal_and_lse_is_flash_attn_lse():
    grid, layout = _grid_layout()
    qkv = _qkv()
    out, lse = _run_mha(grid, layout, qkv)
    i = torch.arange(S)
    ref, ref_lse = _attention(*qkv, i[None, :] <= i[:, None])
    full, _ = _attention(*qkv, torch.ones(S, S, dtype=torch.bool))
    assert (out - ref).abs().max().item() < 1e-12
    assert (lse - ref_lse).abs().max().item() < 1e-12
    assert (out - full).abs().max().item() > 1e-2  # the default is not full attention (flash-attn's)
    out, _ = _run_mha(grid, layout, qkv, causal=False)
    assert (out - full).abs().max().item() < 1e-12


def test_window_is_flash_attn_window_size_minus_one():
    """window=W: a query sees its W latest keys, itself included = flash-attn window_size=(W - 1, 0)."""
    grid, layout = _grid_layout()
    qkv = _qkv()
    out, _ = _run_mha(grid, layout, qkv, window=W)
    i = torch.arange(S)
    errs = {}
    for left in (W - 1, W):
        ref, _ = _attention(*qkv, (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left))
        errs[left] = (out - ref).abs().max().item()
    assert errs[W - 1] < 1e-12 and errs[W] > 1e-2


def _gdn_recurrent(q, k, v, g, beta, h0, l2):
    """flash-linear-attention's recurrent gated delta rule ([B, T, H, *], scale 1 / sqrt(K)); l2: its
    use_qk_l2norm_in_kernel (x / sqrt(|x|^2 + 1e-6))."""
    if l2:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    h, out = h0.clone(), torch.zeros_like(v)
    for t in range(q.shape[1]):
        h = h * g[:, t].exp()[..., None, None]
        u = (v[:, t] - (h * k[:, t, ..., None]).sum(-2)) * beta[:, t, ..., None]
        h = h + k[:, t, ..., None] * u[..., None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], h)
    return out, h


@pytest.mark.parametrize("l2", [True, False])
def test_gdn_default_normalises_q_and_k(l2):
    grid, layout = _grid_layout()
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, S, H, D, dtype=torch.float64, generator=gen) for _ in range(3))
    k = k * D ** -0.5  # a stable recurrence without the norm too
    g = -0.2 * torch.rand(1, S, H, dtype=torch.float64, generator=gen)
    beta = torch.rand(1, S, H, dtype=torch.float64, generator=gen)
    h0 = 0.1 * torch.randn(1, H, D, D, dtype=torch.float64, generator=gen)
    layer = seqpar.GdnCp(grid, layout) if l2 else seqpar.GdnCp(grid, layout, use_qk_l2norm=False)
    out, final_state = layer(*(seqpar.shard_sequence(t, layout, grid.cp_rank) for t in (q, k, v, g, beta)),
                             initial_state=h0)
    out = seqpar.gather_sequence(grid, layout, out)
    ref, ref_state = _gdn_recurrent(q, k, v, g, beta, h0, l2)
    other, _ = _gdn_recurrent(q, k, v, g, beta, h0, not l2)
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() < 1e-10 * scale
    assert (final_state - ref_state).abs().max().item() < 1e-10 * ref_state.abs().max().item()
    assert (out - other).abs().max().item() > 1e-3 * scale


def test_zigzag_split_is_ring_flash_attn_zigzag():
    """Rank r holds chunks r and 2P-1-r of 2P, as ring-flash-attn's and YunChang's zigzag split."""
    grid, layout = _grid_layout()
    x = torch.arange(S, dtype=torch.float64).reshape(1, S, 1)
    chunks = x.chunk(2 * WORLD, dim=1)
    theirs = torch.cat([chunks[grid.cp_rank], chunks[2 * WORLD - 1 - grid.cp_rank]], dim=1)
    assert torch.equal(seqpar.shard_sequence(x, layout, grid.cp_rank), theirs)
