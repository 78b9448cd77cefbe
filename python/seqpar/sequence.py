"""Cutting a full batch into this rank's piece of a SequenceLayout and putting it back together.

The full tensor holds the row's seq_len real tokens ([B, T, ...], B = 1 for a packed row); a rank's piece holds
layout.local_len slots, some of which may be padding (layout.token_index(cp_rank) = -1): zeros on the way in,
dropped on the way out.
"""

import torch

from . import _seqpar


def shard_sequence(full, layout, cp_rank, seq_dim=1):
    """This CP rank's piece of `full` ([B, T, ...] with seq_dim 1): row i is token layout.token_index(cp_rank)[i],
    or zeros for a padding row.

    A torch index_select, so it is differentiable (its gradient scatters back into the full tensor, padding rows
    dropped) and needs no communication: every rank holds the full batch (the usual data loader), each keeps its piece.
    Raises seqpar.Error when `full` does not hold exactly layout.seq_len tokens along seq_dim (the same on every rank).
    """
    if not -full.dim() <= seq_dim < full.dim():
        raise _seqpar.Error(
            f"shard_sequence: seq_dim {seq_dim} is not a dimension of the full tensor of shape {tuple(full.shape)}")
    if full.shape[seq_dim] != layout.seq_len:
        raise _seqpar.Error(
            f"shard_sequence: the full tensor of shape {tuple(full.shape)} has length {full.shape[seq_dim]} in "
            f"dimension {seq_dim} (seq_dim), but the layout's seq_len is {layout.seq_len} (its total tokens): pass "
            f"the whole sequence, or a layout for length {full.shape[seq_dim]}")
    tokens = layout.token_index(cp_rank)
    padding = tokens < 0
    if not bool(padding.any()):
        return full.index_select(seq_dim, tokens)
    zero_shape = list(full.shape)
    zero_shape[seq_dim] = 1
    with_zero = torch.cat([full, full.new_zeros(zero_shape)], seq_dim)  # row T: the zeros of every padding row
    return with_zero.index_select(seq_dim, tokens.masked_fill(padding, full.shape[seq_dim]))


def scatter_sequence(grid, layout, full, root=0):
    """Collective over grid.cp: root's full [B, T, ...] tensor is cut by the layout, every rank gets its
    [B, local_len, ...] piece (padding rows zero).

    Every rank passes a tensor of the full shape and dtype (read on `root` only). No autograd.
    """
    shape = list(full.shape)
    shape[1] = layout.local_len
    local = torch.empty(shape, dtype=full.dtype)
    _seqpar.scatter_sequence(grid, layout, full.detach(), local, root)
    return local


def gather_sequence(grid, layout, local, seq_dim=1):
    """Collective over grid.cp: every rank's piece gathered into the full tensor of seq_len rows on every rank
    (padding rows dropped; seq_dim 1 for [B, T, ...], 2 for [B, H, T] such as lse). No autograd (for evaluation,
    checks and outputs)."""
    if not 0 <= seq_dim < local.dim():
        raise _seqpar.Error(f"gather_sequence: seq_dim {seq_dim} is not a dimension of the local tensor of shape "
                            f"{tuple(local.shape)} (1 for [B, T, ...], 2 for [B, H, T])")
    shape = list(local.shape)
    shape[seq_dim] = layout.seq_len
    full = torch.empty(shape, dtype=local.dtype)
    _seqpar.gather_sequence(grid, layout, local.detach(), full, seq_dim)
    return full
