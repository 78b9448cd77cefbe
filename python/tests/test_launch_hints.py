"""What a new user meets first: a grid larger than a single-process launch says how to launch; a sharded input of
the wrong length names the layout and the shard helper."""

import pytest
import torch

import seqpar

WORLD = seqpar.world().size


@pytest.mark.skipif(WORLD != 1, reason="needs a world of one process (the np1 run checks it)")
def test_world_of_one_asked_for_more_says_how_to_launch():
    with pytest.raises(seqpar.Error, match=r"alone \(MPI world size 1\).*mpirun -np 4 python3.*under torchrun, "
                                           r"build the grid .*seqpar\.torch_grid\(process_group="):
        seqpar.CpGrid(1, 2, 2)


@pytest.mark.parametrize("layer", ["mha", "gdn", "conv"])
def test_wrong_rows_name_the_layout(layer):
    """Rows that do not match the layout's local_len (a torch.chunk of a padded sequence, here one row more): the
    error names the layout kind, local_len and shard_sequence, on every rank."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 30, "zigzag")
    n = layout.local_len + 1
    with pytest.raises(seqpar.Error, match=rf"the zigzag layout gives CP rank {grid.cp_rank} "
                                           rf"local_len={layout.local_len}.*seqpar.shard_sequence"):
        if layer == "mha":
            seqpar.MhaCp(grid, layout)(*(torch.randn(1, n, 2, 8) for _ in range(3)))
        elif layer == "gdn":
            q = torch.randn(1, n, 2, 8)
            seqpar.GdnCp(grid, layout)(q, q, q, -torch.rand(1, n, 2), torch.rand(1, n, 2))
        else:
            seqpar.ShortConvCp(grid, layout, 8)(torch.randn(1, n, 8))


@pytest.mark.parametrize("layer", ["mha", "gdn"])
def test_heads_first_input_says_the_order(layer):
    """q, k, v in SDPA's [B, H, S, D] order (a user coming from torch): the error says seqpar's [B, S, H, D] and the
    transpose; a plain wrong length does not mention the order."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 32 * WORLD, "zigzag")
    s = layout.local_len
    x = torch.randn(1, 3, s, 8)  # [B, H, S, D]
    with pytest.raises(seqpar.Error, match=r"local_len=.*takes \[B, S, H, D\].*\.transpose\(1, 2\)"):
        if layer == "mha":
            seqpar.MhaCp(grid, layout)(x, x, x)
        else:
            seqpar.GdnCp(grid, layout)(x, x, x, -torch.rand(1, s, 3), torch.rand(1, s, 3))
    with pytest.raises(seqpar.Error) as e:
        seqpar.MhaCp(grid, layout)(*(torch.randn(1, s + 1, 3, 8) for _ in range(3)))
    assert "transpose" not in str(e.value)


@pytest.mark.parametrize("layer", ["mha", "gdn", "dsa"])
def test_wrong_rank_has_no_rows_hint(layer):
    """An input of the wrong number of dimensions (q without its batch dimension) is refused for its shape; its dim 1
    is no row count, so the error carries no hint about the layout's rows (it used to say 'got rows [H, H, H]')."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 32 * WORLD, "zigzag")
    s = layout.local_len
    with pytest.raises(seqpar.Error) as e:
        if layer == "mha":
            x = torch.randn(s, 3, 8)  # [S, H, D]: no batch dimension
            seqpar.MhaCp(grid, layout)(x, x, x)
        elif layer == "gdn":
            x = torch.randn(s, 2, 8)
            seqpar.GdnCp(grid, layout)(x, x, x, -torch.rand(1, s, 2), torch.rand(1, s, 2))
        else:
            seqpar.DsaCp(grid, layout, topk=4, dim_v=8)(torch.randn(s, 2, 16), torch.randn(1, s, 16),
                                                         torch.randn(1, s, 2, 8), torch.randn(1, s, 8),
                                                         torch.rand(1, s, 2))
    assert "got rows" not in str(e.value) and "local_len=" not in str(e.value), str(e.value)


def test_apply_rope_names_the_layout():
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 30, "zigzag")
    with pytest.raises(ValueError, match="zigzag layout.*shard_sequence"):
        seqpar.apply_rope(torch.randn(1, layout.local_len + 1, 2, 8), layout, grid.cp_rank)
