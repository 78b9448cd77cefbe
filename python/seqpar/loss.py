"""The next-token loss of a sequence sharded over CP ranks.

Two rules make the sharded loss equal the unsharded one:
  - shift, then shard: the label of token t is token t + 1 of the whole sequence, which usually lives on another
    rank; shift the full labels before cutting them (shard_labels does both). In a packed row the last token of
    each document has no label (ignore_index): no document predicts the next one's first token.
  - divide by the global token count: each rank's loss is the sum over its own tokens divided by the number of
    labelled tokens of the whole sequence (all CP ranks), so that the ranks' losses add up to the mean.
"""

import torch
import torch.nn.functional as F

from . import _seqpar


def shift_labels(labels, cu_seqlens=None, ignore_index=-100):
    """Next-token labels of full sequences: labels [B, T] -> [B, T] where position t holds labels[:, t + 1], and
    the last position of each row (of each document, with cu_seqlens [N + 1] of a packed row) holds ignore_index."""
    if labels.dim() != 2:
        raise _seqpar.Error(f"shift_labels: labels must be [B, T], got shape {tuple(labels.shape)}")
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        ends = torch.as_tensor(cu_seqlens, dtype=torch.int64)[1:] - 1  # the last token of each document
        ends = ends[ends >= 0]
        if ends.numel() and int(ends.max()) >= labels.shape[1]:
            raise _seqpar.Error(f"shift_labels: cu_seqlens ends at {int(ends.max()) + 1}, past the {labels.shape[1]} "
                                f"tokens of the row")
        out[:, ends] = ignore_index
    return out


def shard_labels(labels, layout, cp_rank, ignore_index=-100, shift=True):
    """This CP rank's labels [B, layout.local_len] of the full labels [B, seq_len]: shifted first (shift_labels,
    documents from layout.cu_seqlens for a packed layout; shift=False for labels already shifted), then cut like
    shard_sequence, with ignore_index on padding rows."""
    if labels.dim() != 2 or labels.shape[1] != layout.seq_len:
        raise _seqpar.Error(f"shard_labels: labels must be [B, {layout.seq_len}] (the layout's seq_len), got shape "
                            f"{tuple(labels.shape)}")
    if shift:
        labels = shift_labels(labels, layout.cu_seqlens if layout.is_packed else None, ignore_index)
    tokens = layout.token_index(cp_rank)
    padded = torch.cat([labels, labels.new_full((labels.shape[0], 1), ignore_index)], 1)
    return padded.index_select(1, tokens.masked_fill(tokens < 0, labels.shape[1]))


def sharded_cross_entropy(logits, labels, grid, ignore_index=-100):
    """This rank's share of the mean next-token cross-entropy of the sharded sequence: the sum of the losses of its
    labelled tokens divided by the number of labelled tokens on all ranks of grid.cp (one all-reduce of two int64: the count and a shape check).

    logits [B, L, V] and labels [B, L] (shard_labels) of this rank. The shares of the CP ranks add up to the mean
    over the whole sequence, and so do their gradients once the parameter gradients are summed over the CP group
    (seqpar.all_reduce_cp_gradients). Collective over grid.cp. To log the mean: all-reduce a detached copy."""
    # One all-reduce of (labelled tokens, ranks with bad shapes), so that bad shapes on one rank fail every rank.
    bad = logits.dim() != 3 or labels.dim() != 2 or labels.shape != logits.shape[:2]
    count = torch.zeros(2, dtype=torch.int64)
    count[0] = 0 if bad else int((labels != ignore_index).sum())
    count[1] = int(bad)
    grid.cp.all_reduce(count)
    if count[1] > 0:
        raise _seqpar.Error(f"sharded_cross_entropy: logits [B, L, V] and labels [B, L] expected on every cp rank; "
                            f"{int(count[1])} cp rank(s) have other shapes; this cp rank {grid.cp_rank}: "
                            f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    return total / count[0].clamp(min=1).to(total.dtype)
