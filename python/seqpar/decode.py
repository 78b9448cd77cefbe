"""Inference under context parallelism: the prompt's prefill under CP fills caches that stay sharded over the group,
then decode steps attend each new token to them (parallel/decode_cp.h, parallel/dsa_decode_cp.h; docs/design.md,
"MHA decode over a sharded cache", "DSA decode", "GDN decode").

    dec = seqpar.MhaDecodeCp(grid)                                      # interleave sharding over the ring group
    cache = dec.make_cache(batch=1, capacity=T + steps, kv_heads=Hkv, head_dim=D, dtype=torch.bfloat16)
    layout = seqpar.SequenceLayout.for_grid(grid, T)                    # the prompt's layout
    out, lse = dec.prefill(cache, layout, *(seqpar.shard_sequence(t, layout, grid.cp_rank) for t in (q, k, v)))
    out, lse = dec.decode(cache, q_new, k_new, v_new)                  # [B, n, Hq, D], all heads, every rank

Every call is collective over the grid's CP group (every rank calls it in the same order with the same shapes) and
checks, before any data moves, that the ranks agree; a refused call leaves the cache as it was. The prompt's inputs
are this rank's rows of the layout (shard_sequence), the decode inputs are the new tokens' rows, all heads,
identical on every rank. The caches are Python objects holding this rank's shard (ShardedKvCache, ShardedDsaCache,
GdnCache); `cache.length` is the tokens held by the whole cache. No autograd (inference): inputs are detached.

Devices (MHA): `make_cache(..., device=torch.device("cuda"))` puts the cache on a CUDA device (a CUDA build of
seqpar; `cache.device`); prefill, fill and decode then take their tensors on that device and run on torch's current
stream, and return results there. Inputs on another device than the cache are refused by name (every rank, before
any message); extend (chunked prefill) is host-only and refuses a device cache. DSA and GDN decode: host only.

Heads in the results: MHA decode computes Hq / ulysses_size query heads per rank and GDN decode Hv / cp_size value
heads per rank (the heads are split, docs/design.md); with all_heads=True (the default) the pieces are summed into
the full [B, n, H, D] on every rank (one all_reduce), with all_heads=False the rank's heads come back alone
(heads from `q_head_offset(Hq)` / `head_offset`), for a caller whose output projection reduces over heads itself.
"""

import torch

from . import _seqpar

_DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _dtype_name(dtype):
    if dtype not in _DTYPE_NAMES:
        raise _seqpar.Error(f"cache dtype {dtype} is not supported: expected one of {list(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[dtype]


def _c(t):
    return None if t is None else t.detach().contiguous()


def _agree_all_heads(obj, all_heads):
    """Every rank of the CP group passes the same all_heads (on one rank alone it would pair the step's all_reduce
    with the next call's messages): agreed before the step, cached like the layers' checks (a repeated value sends
    nothing; docs/operations.md, "Ranks that disagree")."""
    check = obj.__dict__.get("_agreement")
    if check is None:
        check = obj.__dict__["_agreement"] = _seqpar.AgreementCheck()
    check.run(obj.grid.cp, f"{type(obj).__name__}.decode (Python)", [("all_heads", "yes" if all_heads else "no")])


def _all_heads(local, offset, total, group, dim):
    """The full tensor with `total` heads along `dim` from every rank's `local` heads starting at `offset`: each rank
    writes its heads into zeros and the group sums (ranks holding the same heads, e.g. the ring ranks of a Ulysses
    group, are counted once: the caller passes the group whose ranks hold disjoint heads)."""
    shape = list(local.shape)
    shape[dim] = total
    full = torch.zeros(shape, dtype=local.dtype, device=local.device)
    full.narrow(dim, offset, local.shape[dim]).copy_(local)
    if full.is_cuda:  # the communicator reads the buffer on its own stream: finish torch's writes first
        torch.cuda.current_stream(full.device).synchronize()
    group.all_reduce(full)
    return full


class MhaDecodeCp:
    """MHA / GQA causal inference over a K/V cache sharded by token over the ring group (heads over the Ulysses group).

    shard: "interleave" (token t on ring rank (t // interleave) % ring_size) or "contiguous"; scale <= 0: 1/sqrt(D);
    prefill_impl: the prompt's ring ("p2p" or "allgather")."""

    def __init__(self, grid, shard="interleave", interleave=1, scale=0.0, prefill_impl="p2p"):
        self.grid = grid
        self.layer = _seqpar.MhaDecodeCp(grid, _seqpar.MhaDecodeConfig(shard, interleave, scale, prefill_impl))

    def make_cache(self, batch, capacity, kv_heads, head_dim, dtype=torch.float32, device="cpu"):
        """An empty cache of `capacity` tokens (the whole cache's; this rank holds its shard) on `device` (a
        torch.device or its name: "cpu", "cuda" (torch's current CUDA device), "cuda:N"), allocated once, as
        torch.empty(..., device=) and a static KV cache are."""
        return self.layer.make_cache(batch, capacity, kv_heads, head_dim, _dtype_name(dtype), str(torch.device(device)))

    def prefill(self, cache, layout, q, k, v):
        """The prompt: q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D], this rank's rows of `layout` (seq_len T =
        the prompt length), on the cache's device. Returns (out [B, S_local, Hq, D], lse [B, Hq, S_local]) in the
        layout's rows, on that device."""
        return self.layer.prefill(cache, layout, _c(q), _c(k), _c(v))

    def fill(self, cache, layout, k, v):
        """prefill without the prompt's attention (the cache takes k, v)."""
        self.layer.fill(cache, layout, _c(k), _c(v))

    def extend(self, cache, layout, q, k, v, mode="auto"):
        """A chunk of layout.seq_len tokens after the cache's length (chunked prefill, a multi-turn prompt): rows as
        in prefill (token i of the chunk is position cache.length + i). mode "auto", "pass-kv" or "pass-q". Host
        only: a cache on a CUDA device is refused (prefill it whole, then decode)."""
        return self.layer.extend(cache, layout, _c(q), _c(k), _c(v), mode)

    def decode(self, cache, q_new, k_new, v_new, all_heads=True):
        """n new tokens: q_new [B, n, Hq, D], k_new, v_new [B, n, Hkv, D], identical on every rank. Returns
        (out [B, n, Hq, D], lse [B, Hq, n]) (module docstring for all_heads=False)."""
        _agree_all_heads(self, all_heads)
        out, lse = self.layer.decode(cache, _c(q_new), _c(k_new), _c(v_new))
        if not all_heads or self.grid.ulysses_size == 1:
            return out, lse
        hq = q_new.shape[2]
        offset = self.layer.q_head_offset(hq)
        return (_all_heads(out, offset, hq, self.grid.ulysses, 2), _all_heads(lse, offset, hq, self.grid.ulysses, 1))

    def q_head_offset(self, q_heads):
        return self.layer.q_head_offset(q_heads)


class DsaDecodeCp:
    """DSA inference over an indexer-key and latent cache sharded by token over the CP group; the decode step's
    top-k is global (bitwise that of one device). Every rank returns all heads."""

    def __init__(self, grid, shard="interleave", interleave=1, topk=None, dim_v=None, scale=0.0, window=0,
                 prefill_select="ring"):
        defaults = _seqpar.DsaCpConfig()  # topk and dim_v default to DeepSeek-V3.2's
        config = _seqpar.DsaDecodeConfig(shard, interleave, defaults.topk if topk is None else topk,
                                         defaults.dim_v if dim_v is None else dim_v, scale, window, prefill_select)
        self.grid = grid
        self.layer = _seqpar.DsaDecodeCp(grid, config)

    def make_cache(self, batch, capacity, index_dim, latent_dim, dtype=torch.float32):
        return self.layer.make_cache(batch, capacity, index_dim, latent_dim, _dtype_name(dtype))

    def prefill(self, cache, layout, q, c, q_idx, k_idx, w):
        """The prompt (shapes as seqpar.DsaCp). Returns (out, lse, topk_indices) in the layout's rows."""
        return self.layer.prefill(cache, layout, *(_c(t) for t in (q, c, q_idx, k_idx, w)))

    def decode(self, cache, q_new, c_new, q_idx_new, k_idx_new, w_new):
        """n new tokens ([B, n, ...], identical on every rank). Returns (out [B, n, H, Dv], lse [B, H, n],
        topk_indices [B, n, topk] global token positions, -1 padded)."""
        return self.layer.decode(cache, *(_c(t) for t in (q_new, c_new, q_idx_new, k_idx_new, w_new)))


class GdnDecodeCp:
    """GDN inference with the value heads split over the CP group (Hv and Hk divisible by cp_size), optionally with
    the short conv (conv_width > 0 in make_cache, conv_weight [C, W] in prefill and decode: q, k, v are then the
    conv's inputs, C = 2 Hk K + Hv V channels in the order q, k, v)."""

    def __init__(self, grid, value_heads, key_heads, mode="scan", use_qk_l2norm=True, scale=0.0, chunk_size=None,
                 use_silu=True):
        config = _seqpar.GdnCpConfig(mode, use_qk_l2norm, scale)
        if chunk_size is not None:
            config.chunk_size = chunk_size
        self.grid, self.value_heads = grid, value_heads
        self.layer = _seqpar.GdnDecodeCp(grid, config, value_heads, key_heads, _seqpar.ShortConvCpConfig(use_silu))

    @property
    def head_offset(self):
        return self.layer.head_offset

    def make_cache(self, batch, key_dim, value_dim, dtype=torch.float32, conv_width=0):
        """This rank's heads of the state (fp32; fp64 for fp64) and, with conv_width W > 0, the conv tail."""
        return self.layer.make_cache(batch, key_dim, value_dim, _dtype_name(dtype), conv_width)

    def prefill(self, cache, layout, q, k, v, g, beta, initial_state=None, conv_weight=None):
        """The prompt under CP (shapes as seqpar.GdnCp); returns out [B, S_local, Hv, V] in the layout's rows."""
        return self.layer.prefill(cache, layout, *(_c(t) for t in (q, k, v, g, beta, initial_state, conv_weight)))

    def decode(self, cache, q_new, k_new, v_new, g_new, beta_new, conv_weight=None, all_heads=True):
        """n new tokens, all heads, identical on every rank. Returns out [B, n, Hv, V] (all_heads) or this rank's
        [B, n, Hv / cp_size, V] from head_offset."""
        _agree_all_heads(self, all_heads)
        out = self.layer.decode(cache, *(_c(t) for t in (q_new, k_new, v_new, g_new, beta_new, conv_weight)))
        if not all_heads or self.grid.cp.size == 1:
            return out
        return _all_heads(out, self.layer.head_offset, self.value_heads, self.grid.cp, 2)
