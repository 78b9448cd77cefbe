"""Cutting a full batch into this rank's piece of a SequenceLayout and putting it back together."""

import torch

from . import _seqpar


def shard_sequence(full, layout, sp_rank, seq_dim=1):
    """This SP rank's piece of `full` ([B, S, ...] with seq_dim 1): the rows at layout.positions(sp_rank).

    A torch index_select, so it is differentiable (its gradient scatters back into the full tensor) and needs no
    communication: every rank holds the full batch (the usual data loader), each keeps its piece.
    """
    return full.index_select(seq_dim, layout.positions(sp_rank))


def scatter_sequence(grid, layout, full, root=0):
    """Collective over grid.sp: root's full [B, S, ...] tensor is cut by the layout, every rank gets its piece.

    Every rank passes a tensor of the full shape and dtype (read on `root` only). No autograd.
    """
    shape = list(full.shape)
    shape[1] = layout.local_len
    local = torch.empty(shape, dtype=full.dtype)
    _seqpar.scatter_sequence(grid, layout, full.detach(), local, root)
    return local


def gather_sequence(grid, layout, local, seq_dim=1):
    """Collective over grid.sp: every rank's piece gathered into the full tensor on every rank (seq_dim 1 for
    [B, S, ...], 2 for [B, H, S] such as lse). No autograd (for evaluation, checks and outputs)."""
    shape = list(local.shape)
    shape[seq_dim] = layout.seq_len
    full = torch.empty(shape, dtype=local.dtype)
    _seqpar.gather_sequence(grid, layout, local.detach(), full, seq_dim)
    return full
