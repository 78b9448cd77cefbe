"""seqpar.MhaCp (ring p2p / all-gather, Ulysses, USP; layouts; window; GQA) against materialised softmax
attention on the whole sequence, forward and backward, at every (ulysses_size, ring_size) of the world."""

import pytest
import torch

import seqpar
from references import check_close, mha_reference, random_full, run_against_reference, same_document, usp_grids

B, S, HQ, HKV, D = 1, 48, 4, 2, 16
WORLD = seqpar.world().size

# (impl, causal, window): the window needs causal.
CONFIGS = [("p2p", True, 0), ("p2p", False, 0), ("p2p", True, 7), ("allgather", True, 0), ("allgather", True, 7)]
# Per-dtype tolerance, relative to max(1, max |reference|): fp64 runs fp64 end to end; fp32 rounds each product
# (2^-24) over 48 keys; bf16 / fp16 round the outputs and the incoming gradients to 8 / 11 bits.
RTOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 5e-3}


def run_mha(grid, layout, config, dtype):
    attn = seqpar.MhaCp(grid, layout, config)
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
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, kind)
    run_mha(grid, layout, seqpar.MhaCpConfig(impl=impl, causal=causal, window=window), torch.float64)


# A packed row with a zero-length document and lengths no layout divides; an unpacked odd length.
CU_SEQLENS = [0, 5, 5, 22, 40, 53]
ODD_T = 197


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "balanced"])
@pytest.mark.parametrize("impl,causal,window", CONFIGS, ids=lambda x: str(x))
def test_usp_packed_row_matches_per_document_reference(grid_shape, kind, impl, causal, window):
    """Attention inside each document of a packed row (padded per the layout) against the fp64 materialised
    attention with a per-document mask, forward and backward."""
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.packed_for_grid(grid, torch.tensor(CU_SEQLENS), kind)
    assert layout.is_packed and layout.seq_len == CU_SEQLENS[-1] and layout.padded_len % layout.num_ranks == 0
    assert layout.cu_seqlens.tolist() == CU_SEQLENS
    config = seqpar.MhaCpConfig(impl=impl, causal=causal, window=window)
    attn = seqpar.MhaCp(grid, layout, config)
    T = CU_SEQLENS[-1]
    q, k, v = random_full((1, T, HQ, D)), random_full((1, T, HKV, D)), random_full((1, T, HKV, D))
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v, causal, window, cu_seqlens=CU_SEQLENS)], []),
                          RTOL[torch.float64])
    rope = layout.rope_positions(grid.cp_rank)
    tokens = layout.token_index(grid.cp_rank)
    starts = torch.tensor(CU_SEQLENS)
    doc = torch.bucketize(tokens.clamp(min=0), starts[1:], right=True)
    want = torch.where(tokens >= 0, tokens - starts.index_select(0, doc), 0)
    assert torch.equal(rope, want), "rope_positions are not the offsets inside the documents"


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "stripe"])
@pytest.mark.parametrize("impl", ["p2p", "allgather"])
def test_usp_padded_odd_length(grid_shape, kind, impl):
    """T = 197 tokens, padded to what the layout needs, against the fp64 reference on the 197 tokens."""
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, ODD_T, kind)
    assert layout.seq_len == ODD_T and layout.padded_len >= ODD_T and not layout.is_packed
    attn = seqpar.MhaCp(grid, layout, seqpar.MhaCpConfig(impl=impl, causal=True))
    q, k, v = random_full((B, ODD_T, HQ, D)), random_full((B, ODD_T, HKV, D)), random_full((B, ODD_T, HKV, D))
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v, True)], []), RTOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_usp_dtypes(dtype):
    grid = seqpar.CpGrid(1, *usp_grids(WORLD)[len(usp_grids(WORLD)) // 2])
    run_mha(grid, seqpar.SequenceLayout.for_grid(grid, S), seqpar.MhaCpConfig(), dtype)


def test_lse_and_positions():
    """lse of the local rows and the layout's positions for RoPE."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    attn = seqpar.MhaCp(grid, layout, causal=True)
    pos = layout.positions(grid.cp_rank)
    assert torch.equal(attn.layer.positions, pos) and pos.dtype == torch.int64 and len(pos) == layout.local_len
    everyone = seqpar.gather_sequence(grid, layout, pos.to(torch.float64)[None, :, None], seq_dim=1)
    assert torch.equal(everyone.flatten(), torch.arange(S, dtype=torch.float64)), "the pieces do not tile 0..S-1"
    q, k, v = (torch.randn(B, layout.local_len, h, D, dtype=torch.float64) for h in (HQ, HKV, HKV))
    out, lse = attn(q, k, v, return_lse=True)
    assert lse.shape == (B, HQ, layout.local_len)
    qf, kf, vf = (seqpar.gather_sequence(grid, layout, t) for t in (q, k, v))
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf.repeat_interleave(2, 2)) / D**0.5
    ref_lse = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1)
    check_close("lse", lse, ref_lse.index_select(2, pos), 1e-12)


def test_errors_are_seqpar_errors_on_every_rank():
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    attn = seqpar.MhaCp(grid, layout)
    q = torch.randn(B, layout.local_len, HQ, D, dtype=torch.float64)
    k = torch.randn(B, layout.local_len, HKV, D, dtype=torch.float64)
    with pytest.raises(seqpar.Error, match="not contiguous"):
        attn(q.transpose(1, 2), k, k)
    with pytest.raises(RuntimeError, match="dtype|fp32|fp64"):  # the module casts k, v to q's dtype; the function not
        seqpar.MhaCpFunction.apply(attn.layer, q, k.float(), k)
    with pytest.raises(seqpar.Error, match="cu_seqlens"):
        seqpar.SequenceLayout.packed("zigzag", [0, 9, 4], 2)  # decreasing; arithmetic only: no communication
    with pytest.raises(seqpar.Error, match="not one of"):
        seqpar.MhaCpConfig(impl="ringy")
    with pytest.raises(seqpar.Error):
        seqpar.CpGrid(1, 1, WORLD + 1)


def mha_reference_lse(q, k, v, causal, cu_seqlens=None):
    """(out, lse [B, Hq, S]) of materialised softmax attention (mha_reference's mask), lse by torch.logsumexp."""
    S, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    rep = Hq // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / D**0.5
    visible = same_document(S, cu_seqlens)
    if causal:
        visible &= torch.ones(S, S, dtype=torch.bool).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v), scores.logsumexp(-1)


def lse_loss_run(grid, layout, attn, full, dout, dlse, weight):
    """This rank's loss sum(out * dout) + weight * sum(lse * dlse) over its real rows (dout None: the lse term only)
    and the gradients of q, k, v gathered over the CP group into whole tensors."""
    real = layout.token_index(grid.cp_rank) >= 0
    local = [seqpar.shard_sequence(t.detach(), layout, grid.cp_rank).requires_grad_() for t in full]
    out, lse = attn(*local, return_lse=True)
    loss = weight * (torch.where(real, lse, 0.0) * seqpar.shard_sequence(dlse, layout, grid.cp_rank, seq_dim=2)).sum()
    if dout is not None:
        loss = loss + (out * seqpar.shard_sequence(dout, layout, grid.cp_rank)).sum()
    loss.backward()
    return loss.detach(), [seqpar.gather_sequence(grid, layout, t.grad) for t in local]


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "packed-zigzag", "packed-balanced"])
@pytest.mark.parametrize("impl,causal", [("p2p", True), ("allgather", True), ("p2p", False)], ids=str)
@pytest.mark.parametrize("with_out", [True, False], ids=["out_and_lse", "lse_only"])
def test_a_loss_on_lse_gets_its_gradient(grid_shape, kind, impl, causal, with_out):
    """A loss that uses lse (sum(out * dout) + 1000 * sum(lse * dlse), or the lse term alone) gives q, k, v the
    gradients torch autograd gives the fp64 materialised reference: the lse term is used, not dropped."""
    grid = seqpar.CpGrid(1, *grid_shape)
    packed = kind.startswith("packed-")
    if packed:
        layout = seqpar.SequenceLayout.packed_for_grid(grid, torch.tensor(CU_SEQLENS), kind[len("packed-"):])
    else:
        layout = seqpar.SequenceLayout.for_grid(grid, ODD_T if kind == "zigzag" else S, kind)
    T = layout.seq_len
    attn = seqpar.MhaCp(grid, layout, seqpar.MhaCpConfig(impl=impl, causal=causal))
    full = [random_full((1, T, h, D)) for h in (HQ, HKV, HKV)]
    dout = torch.randn(1, T, HQ, D, dtype=torch.float64) if with_out else None
    dlse = torch.randn(1, HQ, T, dtype=torch.float64)
    out_r, lse_r = mha_reference_lse(*full, causal, CU_SEQLENS if packed else None)
    loss_r = 1000 * (lse_r * dlse).sum() + ((out_r * dout).sum() if with_out else 0)
    loss_r.backward()
    _, grads = lse_loss_run(grid, layout, attn, full, dout, dlse, 1000)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, full):
        want = ref.grad if ref.grad is not None else torch.zeros_like(ref)  # lse alone does not depend on v
        check_close(name, got, want, RTOL[torch.float64])


def test_lse_gradient_matches_finite_differences():
    """The layer's own loss (summed over the CP group) moved along a random direction of q, k, v: the central
    difference equals the gradient's directional derivative."""
    grid = seqpar.CpGrid(1, *usp_grids(WORLD)[len(usp_grids(WORLD)) // 2])
    layout = seqpar.SequenceLayout.packed_for_grid(grid, torch.tensor(CU_SEQLENS), "zigzag")
    attn = seqpar.MhaCp(grid, layout, seqpar.MhaCpConfig(causal=True))
    T = layout.seq_len
    full = [random_full((1, T, h, D)) for h in (HQ, HKV, HKV)]
    dirs = [torch.randn(t.shape, dtype=torch.float64) for t in full]
    dout = torch.randn(1, T, HQ, D, dtype=torch.float64)
    dlse = torch.randn(1, HQ, T, dtype=torch.float64)

    def total_loss(step):
        moved = [(t + step * d).detach() for t, d in zip(full, dirs)]
        loss, grads = lse_loss_run(grid, layout, attn, moved, dout, dlse, 10.0)
        loss = loss.reshape(1).clone()
        grid.cp.all_reduce(loss)
        return loss.item(), grads

    _, grads = total_loss(0.0)
    eps = 1e-5
    numeric = (total_loss(eps)[0] - total_loss(-eps)[0]) / (2 * eps)
    analytic = sum((g * d).sum().item() for g, d in zip(grads, dirs))
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (numeric, analytic)


def test_second_backward_through_one_forward_is_refused():
    """backward(retain_graph=True) and then a second backward through the same forward raise seqpar.Error naming
    retain_graph (the C++ backward released the forward's saved state), for each layer's autograd function; a new
    forward then gives the same gradient as the first backward (against a second, independent forward)."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    attn = seqpar.MhaCp(grid, layout, causal=True)
    q, k, v = (torch.randn(B, layout.local_len, h, D, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    loss = attn(q, k, v).pow(2).sum()
    (first,) = torch.autograd.grad(loss, q, retain_graph=True)
    with pytest.raises(seqpar.Error, match="second backward through one forward.*retain_graph=True"):
        loss.backward()
    (again,) = torch.autograd.grad(attn(q, k, v).pow(2).sum(), q)
    assert torch.equal(first, again)
    gdn = seqpar.GdnCp(grid, layout)
    gq, gk = (torch.randn(B, layout.local_len, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gv = torch.randn(B, layout.local_len, 2, 8, dtype=torch.float64, requires_grad=True)
    g = -torch.rand(B, layout.local_len, 2, dtype=torch.float64)
    beta = torch.rand(B, layout.local_len, 2, dtype=torch.float64)
    out = gdn(gq, gk, gv, g, beta)
    out = out[0] if isinstance(out, tuple) else out
    gloss = out.pow(2).sum()
    gloss.backward(retain_graph=True)
    with pytest.raises(seqpar.Error, match="second backward through one forward"):
        gloss.backward()


def test_double_backward_is_refused():
    """A backward that builds a graph (create_graph=True, for a gradient of a gradient) raises seqpar.Error instead
    of treating the layer's part as a constant, which would give a wrong second derivative without a word."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    attn = seqpar.MhaCp(grid, layout, causal=True)
    q, k, v = (torch.randn(B, layout.local_len, h, D, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    loss = attn(q, k, v).pow(2).sum()
    with pytest.raises(seqpar.Error, match="do not support double backward"):
        torch.autograd.grad(loss, q, create_graph=True)
