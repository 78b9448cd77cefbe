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


@pytest.mark.parametrize("layer", ["mha", "gdn"])
def test_seq_first_input_says_the_order(layer):
    """q, k, v in TransformerEngine's sbhd order [S, B, H, D] (B = 2): the error says seqpar's [B, S, H, D] and
    the transpose of dims 0 and 1."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, 32 * WORLD, "zigzag")
    s = layout.local_len
    x = torch.randn(s, 2, 3, 8)  # [S, B, H, D]
    with pytest.raises(seqpar.Error, match=r"local_len=.*in dim 0.*takes \[B, S, H, D\].*\.transpose\(0, 1\)"):
        if layer == "mha":
            seqpar.MhaCp(grid, layout)(x, x, x)
        else:
            seqpar.GdnCp(grid, layout)(x, x, x, -torch.rand(s, 2, 3), torch.rand(s, 2, 3))


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


@pytest.mark.parametrize("key, says", [
    ("ulysses_degree", r"seqpar's name: ulysses_size= \(YunChang's ulysses_degree\)"),
    ("ring_degree", r"seqpar's name: ring_size= \(YunChang's ring_degree\)"),
    ("sp_ulysses_degree", r"seqpar's name: ulysses_size="),
    ("ring_sise", r"\(its arguments: CpGrid\(dp_size: int = 1, ulysses_size: int = 1, ring_size: int = 1"),
])
def test_cpgrid_names_seqpars_keyword(key, says):
    """YunChang's degree keywords (or a typo) given to CpGrid: a TypeError naming the keyword and seqpar's name,
    instead of pybind's list of constructor overloads; seqpar's own keywords still build the grid."""
    with pytest.raises(TypeError, match=rf"CpGrid\(\) got an unexpected keyword argument '{key}'.*{says}"):
        seqpar.CpGrid(**{key: 1}, ring_size=WORLD)
    with pytest.raises(TypeError, match=r"CpGrid\(ring_size=1, placement=3\): the arguments do not match CpGrid\("):
        seqpar.CpGrid(ring_size=1, placement=3)
    grid = seqpar.CpGrid(ulysses_size=1, ring_size=WORLD)
    assert (grid.dp_size, grid.ulysses_size, grid.ring_size) == (1, 1, WORLD)


@pytest.mark.parametrize("layer, key, value, says", [
    ("mha", "window_size", (7, 0), r"seqpar's name: window=W .*flash-attn's window_size=\(W - 1, 0\)"),
    ("mha", "is_causal", False, r"seqpar's name: causal= \(default True\)"),
    ("mha", "softmax_scale", 0.1, r"seqpar's name: scale="),
    ("gdn", "use_qk_l2norm_in_kernel", True, r"seqpar's name: use_qk_l2norm= \(default True\)"),
    ("gdn", "output_final_state", True, r"GdnCp returns \(out, final_state\) always"),
    ("dsa", "index_topk", 64, r"seqpar's name: topk="),
    ("mha", "causl", True, r"\(its options: impl, causal, window, scale, softcap, dropout_p, dropout_seed, "
                            r"alibi_slopes, sinks, and the group keywords: process_group"),
])
def test_another_librarys_keyword_names_seqpars(layer, key, value, says):
    """A keyword of flash-attn, SDPA, fla or DeepSeek's config (or a typo): a TypeError naming seqpar's option and
    listing the layer's, raised before the grid is resolved; instead of pybind's list of constructor overloads."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    cls = {"mha": seqpar.MhaCp, "gdn": seqpar.GdnCp, "dsa": seqpar.DsaCp}[layer]
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got an unexpected keyword argument '{key}'.*{says}"):
        cls(grid, seqpar.SequenceLayout.for_grid(grid, 32), **{key: value})
    # a known option of the wrong type keeps pybind's message, which names the types
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        cls(grid, 32, scale="big")
    # a config and its fields together: the fields would be ignored
    config = {"mha": seqpar.MhaCpConfig, "gdn": seqpar.GdnCpConfig, "dsa": seqpar.DsaCpConfig}[layer]()
    with pytest.raises(TypeError, match=r"pass config= or its fields, not both \(got config= and scale\)"):
        cls(grid, 32, config=config, scale=0.5)
    # seqpar's own names still build the layer
    fields = {"mha": {"window": 8, "causal": True}, "gdn": {"use_qk_l2norm": False}, "dsa": {"topk": 64}}[layer]
    built = cls(grid, 32, **fields)
    assert all(getattr(built.config, k) == v for k, v in fields.items())
