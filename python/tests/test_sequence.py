"""Layouts, the scatter / gather helpers, communicators (the world and mpi4py ones) and the tensor boundary."""

import pytest
import torch

import seqpar
from references import mha_reference, random_full, run_against_reference, usp_grids

WORLD = seqpar.world().size
S = 24 * WORLD


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "stripe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_scatter_shard_gather_round_trip(grid_shape, kind, dtype):
    """scatter_sequence (from the root) and shard_sequence (local) give the same piece; gather_sequence restores
    the full tensor bit for bit; the pieces' positions tile 0..S-1."""
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, kind)
    full = torch.randn(2, S, 3, 5).to(dtype)
    root_only = full if grid.cp_rank == 0 else torch.full_like(full, float("nan"))  # read on the root only
    local = seqpar.scatter_sequence(grid, layout, root_only)
    assert torch.equal(local, seqpar.shard_sequence(full, layout, grid.cp_rank))
    assert torch.equal(seqpar.gather_sequence(grid, layout, local), full)
    lse_like = full[:, :, 0].transpose(1, 2).contiguous()[:, :, None, :].reshape(2, 5, S)  # [B, H, S]
    lse_local = lse_like.index_select(2, layout.positions(grid.cp_rank))
    assert torch.equal(seqpar.gather_sequence(grid, layout, lse_local, seq_dim=2), lse_like)
    everyone = torch.cat([layout.positions(r) for r in range(layout.num_ranks)]).sort().values
    assert torch.equal(everyone, torch.arange(S))


@pytest.mark.parametrize("length", [S + 16, S - 4], ids=["longer", "shorter"])
@pytest.mark.parametrize("seq_dim", [1, 2])
def test_shard_sequence_refuses_a_wrong_length(length, seq_dim):
    """A full tensor longer or shorter than the layout's seq_len is refused on every rank, before any communication,
    naming its length, the layout's seq_len and the dimension (it used to be cut from its first seq_len tokens, or
    to fail inside torch on the rank whose piece reached past its end)."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    shape = [2, 3, 5]
    shape[seq_dim] = length
    full = torch.randn(shape)
    with pytest.raises(seqpar.Error, match=rf"has length {length} in dimension {seq_dim} .*layout's seq_len is {S}"):
        seqpar.shard_sequence(full, layout, grid.cp_rank, seq_dim=seq_dim)
    with pytest.raises(seqpar.Error, match="seq_dim 3 is not a dimension"):
        seqpar.shard_sequence(torch.randn(2, S, 5), layout, grid.cp_rank, seq_dim=3)
    for bad in (3, 7, -1):
        with pytest.raises(seqpar.Error, match=rf"gather_sequence: seq_dim {bad} is not a dimension"):
            seqpar.gather_sequence(grid, layout, torch.randn(2, layout.local_len, 5), seq_dim=bad)
    assert seqpar.shard_sequence(torch.randn(2, S, 5), layout, grid.cp_rank).shape == (2, layout.local_len, 5)


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["zigzag", "contiguous", "stripe", "balanced"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_padded_and_packed_round_trip(grid_shape, kind, packed):
    """A packed row (a zero-length document, lengths no layout divides) or an odd unpacked length: scatter and
    shard give the same piece, padding rows zero; gather restores the T-row tensor bit for bit; the real rows'
    token_index tile 0..T-1; shard_sequence's gradient lands on the tokens and drops the padding."""
    grid = seqpar.CpGrid(1, *grid_shape)
    cu_seqlens = [0, 3, 3, 17, 29, 30]
    if packed:
        layout = seqpar.SequenceLayout.packed_for_grid(grid, cu_seqlens, kind)
    else:
        layout = seqpar.SequenceLayout.for_grid(grid, 31, kind)
    T = layout.seq_len
    assert layout.is_packed == packed and layout.padded_len == layout.local_len * layout.num_ranks >= T
    assert layout.cu_seqlens.tolist() == (cu_seqlens if packed else [0, T])
    full = torch.randn(1, T, 3, 2, dtype=torch.float64, requires_grad=True)
    local = seqpar.scatter_sequence(grid, layout, full)
    tokens = layout.token_index(grid.cp_rank)
    assert local.shape == (1, layout.local_len, 3, 2) and tokens.shape == (layout.local_len,)
    assert torch.equal(local, seqpar.shard_sequence(full, layout, grid.cp_rank).detach())
    assert torch.equal(local[:, tokens < 0], torch.zeros_like(local[:, tokens < 0])), "padding rows are not zero"
    assert torch.equal(local[:, tokens >= 0], full.detach()[:, tokens[tokens >= 0]])
    assert torch.equal(seqpar.gather_sequence(grid, layout, local), full.detach())
    everyone = torch.cat([layout.token_index(r) for r in range(layout.num_ranks)])
    assert torch.equal(everyone[everyone >= 0].sort().values, torch.arange(T))
    assert int((everyone < 0).sum()) == layout.padded_len - T
    seqpar.shard_sequence(full, layout, grid.cp_rank).sum().backward()
    want = torch.zeros(T, dtype=torch.float64).index_fill(0, tokens[tokens >= 0], 1.0)
    assert torch.equal(full.grad[0, :, 0, 0], want)


def test_layout_repr():
    """repr names the kind, the real and padded lengths (padding from the kinds' rules in parallel/layout.h), the
    group sizes and, for a packed row only, the number of documents."""
    plain = seqpar.SequenceLayout("contiguous", 30, ring_size=2, ulysses_size=2)  # padded to a multiple of P U = 4
    assert repr(plain) == "SequenceLayout(kind='contiguous', seq_len=30, padded_len=32, ring_size=2, ulysses_size=2)"
    # zigzag pads each document to a multiple of 2P = 4 slots: 3 -> 4, 0 -> 0, 14 -> 16
    packed = seqpar.SequenceLayout.packed("zigzag", [0, 3, 3, 17], ring_size=2)
    assert packed.num_docs == 3
    assert repr(packed) == (
        "SequenceLayout(kind='zigzag', seq_len=17, padded_len=20, ring_size=2, ulysses_size=1, num_docs=3)"
    )


def test_grid_coordinates_and_groups():
    for u, r in usp_grids(WORLD):
        for placement in ("ulysses_inner", "ring_inner"):
            grid = seqpar.CpGrid(1, u, r, placement)
            assert (grid.ulysses.size, grid.ring.size, grid.cp.size, grid.dp.size) == (u, r, u * r, 1)
            assert grid.cp_rank == grid.ring_rank * u + grid.ulysses_rank == grid.cp.rank
            assert grid.placement == placement and grid.world_rank == seqpar.world().rank
    if WORLD % 2 == 0:
        grid = seqpar.CpGrid(2, 1, WORLD // 2)
        assert grid.dp.size == 2 and grid.dp_rank == seqpar.world().rank // (WORLD // 2)


def test_mpi4py_communicator():
    """A grid over an mpi4py communicator (duplicated): here each half of the world is its own CP group, and
    attention on it matches the reference on the whole sequence."""
    MPI = pytest.importorskip("mpi4py.MPI")
    world = MPI.COMM_WORLD
    half = world.Split(world.Get_rank() % 2 if WORLD > 1 else 0, world.Get_rank())
    grid = seqpar.CpGrid(1, 1, half.Get_size(), comm=half)
    assert grid.world.name == "mpi4py" and grid.world.size == half.Get_size()
    layout = seqpar.SequenceLayout.for_grid(grid, 48)
    attn = seqpar.MhaCp(grid, layout)
    q, k, v = (random_full((1, 48, 2, 8)) for _ in range(3))
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v)], []), 1e-10)
    half.Free()


def test_raw_bindings_outputs_and_context():
    """The raw binding: outputs are torch tensors over seqpar's own buffers (contiguous, writable), the context is
    consumed by the backward and refused the second time, and a dtype outside the four is refused by name."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    raw = seqpar._seqpar.MhaCp(grid, layout, seqpar.MhaCpConfig())
    q = torch.randn(1, layout.local_len, 2, 8)
    out, lse, ctx = raw.forward(q, q, q)
    assert out.is_contiguous() and out.dtype == torch.float32 and lse.dtype == torch.float32 and ctx.live
    out.add_(1.0)  # writable
    dq, dk, dv, dsinks = raw.backward(ctx, torch.ones_like(out))  # dsinks: None without sinks
    assert not ctx.live and dq.shape == q.shape and dsinks is None
    with pytest.raises(seqpar.Error, match="(?i)context"):
        raw.backward(ctx, torch.ones_like(out))  # a context is used once
    with pytest.raises(seqpar.Error, match="float64, float32, bfloat16, float16"):
        raw.forward(q.to(torch.complex64), q, q)
