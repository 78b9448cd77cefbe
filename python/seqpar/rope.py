"""Rotary position embeddings on this rank's piece of a sharded sequence.

A rank's rows are not a contiguous range of the sequence (zigzag holds two chunks, stripe every n-th token, a packed
row restarts positions in every document), so RoPE must take each row's position from the layout:
layout.rope_positions(cp_rank) (the offset inside the row's document; 0 on padding rows). Applying RoPE with
positions 0..S_local-1, or to a torch.chunk of the sequence, is silently wrong.
"""

import torch


def rope_cos_sin(positions, head_dim, base=10000.0, dtype=torch.float32):
    """cos, sin [S, head_dim] of the rotate-half form (Llama, Qwen: frequencies base^(-2i/head_dim) repeated
    twice) at `positions` (int64 [S]). Computed in fp64, returned in `dtype`."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, layout, cp_rank, base=10000.0, positions=None):
    """x [B, S_local, H, D] (this rank's rows of `layout`) rotated at the rows' positions (layout.rope_positions,
    or `positions` [S_local]): x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]. Differentiable."""
    if positions is None:
        positions = layout.rope_positions(cp_rank)
    if x.shape[1] != positions.shape[0]:
        raise ValueError(f"apply_rope: x has {x.shape[1]} rows in dimension 1 but the {layout.kind} layout gives "
                         f"CP rank {cp_rank} {positions.shape[0]} rows (layout.local_len): shard with "
                         f"seqpar.shard_sequence, not torch.chunk")
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: x of shape {tuple(x.shape)} must be [B, S_local, H, D] with an even head_dim D "
                         f"(the rotate-half form pairs dimension i with i + D/2)")
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, x.dtype)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin
