"""Real-valued options travel as doubles: the configs read an explicit scale / softcap back exactly, and MhaCp in
fp64 with an explicit scale matches torch's scaled_dot_product_attention with the same scale to fp64 accuracy (an
fp32 rounding of the scale would show as a 1e-8 error), forward and backward, at every (ulysses_size, ring_size)."""

import math

import pytest
import torch

import seqpar
from references import random_full, run_against_reference, usp_grids

B, S, H, D = 1, 40, 4, 8
WORLD = seqpar.world().size
SCALES = [1 / math.sqrt(D), 0.1]  # neither is an fp32 value


def test_configs_read_real_options_back_exactly():
    c = seqpar.MhaCpConfig(scale=0.1, softcap=0.3)
    assert c.scale == 0.1 and c.softcap == 0.3
    c.softcap = 1 / 3
    assert c.softcap == 1 / 3
    assert seqpar.GdnCpConfig(scale=0.1).scale == 0.1
    assert seqpar.DsaCpConfig(scale=0.1).scale == 0.1


@pytest.mark.parametrize("grid_shape", usp_grids(WORLD), ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("scale", SCALES, ids=["inv_sqrt_d", "0.1"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_mha_explicit_scale_fp64_matches_sdpa(grid_shape, scale, causal):
    grid = seqpar.CpGrid(1, *grid_shape)
    layout = seqpar.SequenceLayout.for_grid(grid, S, "zigzag")
    attn = seqpar.MhaCp(grid, layout, scale=scale, causal=causal)
    assert attn.config.scale == scale

    def sdpa(q, k, v):  # [B, S, H, D] <-> torch's [B, H, S, D]
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                               is_causal=causal, scale=scale)
        return [out.transpose(1, 2)], []

    qkv = [random_full((B, S, H, D)) for _ in range(3)]
    run_against_reference(grid, layout, qkv, [], lambda q, k, v: ([attn(q, k, v)], []), sdpa, 1e-12)
