"""Hugging Face transformers under seqpar context parallelism (transformers is imported here only, by register()).

    import seqpar, seqpar.hf
    seqpar.hf.register()                                    # attn_implementation="seqpar"; Qwen3-Next's GDN layer
    model = AutoModelForCausalLM.from_config(config, attn_implementation="seqpar")
    seqpar.hf.replace_gated_delta_net(model)                # Qwen3-Next only: its linear-attention layers on GdnCp
    batch = seqpar.hf.shard_batch(grid, input_ids, labels=input_ids)      # this rank's rows, positions, labels
    with seqpar.hf.context_parallel(grid, batch.layout):
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)

What each piece does:
- The attention function (registered with transformers' AttentionInterface under "seqpar") runs seqpar.MhaCp on
  the rank's rows: GQA, causal, the model's scaling, sliding_window, softcap, sinks (s_aux) and attention dropout;
  ring attention, Ulysses or USP by the grid. It needs an active context_parallel(grid, layout) (an error says so
  otherwise). A mask function registered under the same name builds no mask (causality and documents are the
  layout's) and refuses a 2-D attention_mask with zeros on every rank (padding belongs in the layout: pack the
  documents, shard_batch(cu_seqlens=...)).
- Positions: a rank's rows are not a contiguous range (zigzag holds two chunks; a packed row restarts in every
  document), so the model must get position_ids = layout.rope_positions(cp_rank): shard_batch returns them, and the
  model's own rotary embedding then rotates every row at its true position.
- Packed rows: shard_batch(position_ids=...) (restarts at 0 mark the documents, as transformers' collators make
  them) or cu_seqlens=[0, ...] builds a packed layout; attention stays inside each document.
- Qwen3-Next: replace_gated_delta_net(model) makes each Qwen3NextGatedDeltaNet run its short conv (ShortConvCp,
  halo exchange) and gated delta rule (GdnCp) under CP, with the layer's own parameters; outside a
  context_parallel block it runs transformers' code unchanged.
- Loss: labels are shifted before sharding (shard_batch(labels=...) returns shift_labels, -100 at the last token of
  every document and on padding rows) and the mean uses the global token count (num_items_in_batch); pass both to
  the model (labels=..., shift_labels=..., num_items_in_batch=...) or compute the loss yourself; the ranks' losses
  then sum to the loss of the whole batch.
- Generation: seqpar.hf.generate(model, grid, input_ids, max_new_tokens) decodes greedily with the K/V caches
  sharded over the ring group (seqpar.MhaDecodeCp: the prompt's prefill under CP fills them, each step attends
  the new token to them); transformers' own generate() cannot (its caches are whole-sequence torch tensors).
  Qwen3-Next's replaced GDN layers keep their state and conv tail split by value heads (seqpar.GdnDecodeCp).
"""

import contextlib
import dataclasses
import threading

import torch

from . import _seqpar
from .layers import GdnFunction, MhaCp, ShortConvFunction, _in_dtype
from .sequence import shard_sequence

_state = threading.local()


@dataclasses.dataclass
class _Active:
    grid: object
    layout: object
    impl: str
    gdn_mode: str
    decoding: object = None  # a _Decoding inside generate()


def _active():
    active = getattr(_state, "active", None)
    if active is None:
        raise _seqpar.Error("seqpar.hf: attn_implementation='seqpar' runs inside `with seqpar.hf.context_parallel("
                            "grid, layout):` (no context is active on this thread)")
    return active


@contextlib.contextmanager
def context_parallel(grid, layout, impl="p2p", gdn_mode="scan"):
    """The grid and layout of the rows the model gets inside the block (seqpar.hf's attention and GDN read them).
    impl: the ring's ("p2p" or "allgather"); gdn_mode: "scan" or "chain"."""
    previous = getattr(_state, "active", None)
    _state.active = _Active(grid, layout, impl, gdn_mode)
    try:
        yield
    finally:
        _state.active = previous


def _per_module(module, attr, key, make):
    """A seqpar layer cached on the transformers module, made again when `key` (grid, layout, options) changes."""
    cached = getattr(module, attr, None)
    if cached is None or cached[0] != key:
        cached = (key, make(cached[1] if cached is not None else None))
        object.__setattr__(module, attr, cached)  # not a submodule: no parameters, not in state_dict
    return cached[1]


_PADDING_MESSAGE = ("seqpar.hf: a 2-D attention_mask with padding is not supported under CP: pack the documents into "
                    "one row (seqpar.hf.shard_batch(..., cu_seqlens=...)) instead")


def seqpar_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                             sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention-function signature: query [B, Hq, S_local, D], key, value [B, Hkv, S_local, D] (this
    rank's rows of the active layout) -> (out [B, S_local, Hq, D], None)."""
    active = _active()
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise _seqpar.Error(_PADDING_MESSAGE)
    if kwargs.get("output_attentions", False):
        raise _seqpar.Error("seqpar.hf: output_attentions is not available (the scores are never materialised)")
    window = int(sliding_window) if sliding_window else 0
    options = (bool(causal), float(scaling or 0.0), window, float(softcap or 0.0), float(dropout))
    key_ = (id(active.grid), id(active.layout), active.impl, options, None if s_aux is None else s_aux.data_ptr())

    def make(previous):
        layer = MhaCp(active.grid, active.layout, impl=active.impl, causal=causal, window=window,
                      scale=float(scaling or 0.0), softcap=float(softcap or 0.0), dropout_p=float(dropout),
                      sinks=s_aux)
        layer._keep = (active.grid, active.layout)
        if previous is not None:  # the dropout seed keeps advancing across batches
            layer._num_dropout_calls = previous._num_dropout_calls
        return layer

    if active.decoding is not None:
        return active.decoding.attention(module, query, key, value, scaling, window, softcap, s_aux), None
    attn = _per_module(module, "_seqpar_attention", key_, make)
    attn.train(module.training)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    return attn(q, k, v), None


def seqpar_attention_mask(*args, attention_mask=None, **kwargs):
    """transformers' mask-function signature (masking_utils.AttentionMaskInterface): no mask (the layout holds
    causality and the documents; seqpar_attention_forward gets None). A 2-D attention_mask with zeros (padding) is
    refused on every rank of the CP group alike: whether a rank's mask pads is agreed first (one small all-reduce per
    mask), so that no rank goes on into the layers' collectives while another stops."""
    padded = attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all())
    active = _active()
    _seqpar.AgreementCheck().run(active.grid.cp, "seqpar.hf attention_mask",
                                 [("padding", "yes" if padded else "no")])
    if padded:
        raise _seqpar.Error(_PADDING_MESSAGE)
    return None


def register(name="seqpar"):
    """Registers the attention function with transformers' AttentionInterface and its mask function with
    AttentionMaskInterface under `name` (then attn_implementation=name selects both). Imports transformers.
    Without the mask function transformers would pass no mask at all, and a padded attention_mask would be ignored."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, seqpar_attention_forward)
    AttentionMaskInterface.register(name, seqpar_attention_mask)


# ---- batches --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CpBatch:
    """This rank's piece of a batch: the layout, input_ids [B, S_local], position_ids [B, S_local] (the layout's
    RoPE positions), and with labels: shift_labels [B, S_local] (-100 where no next token) and num_items_in_batch
    (the global count of labels other than -100)."""
    layout: object
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor = None
    num_items_in_batch: int = None

    def model_kwargs(self):
        """The keyword arguments of a transformers causal LM call (use_cache off: no cache under CP)."""
        kw = dict(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False)
        if self.shift_labels is not None:
            kw.update(labels=self.shift_labels, shift_labels=self.shift_labels,
                      num_items_in_batch=self.num_items_in_batch)
        return kw


def cu_seqlens_from_position_ids(position_ids):
    """Document boundaries of one packed row from position ids that restart at 0 in every document (as
    transformers' DataCollatorWithFlattening makes them): [0, starts..., T]."""
    pos = torch.as_tensor(position_ids).reshape(-1)
    if pos.numel() == 0 or int(pos[0]) != 0:
        raise _seqpar.Error("seqpar.hf: packed position_ids must start at 0 (a document starts where they are 0)")
    starts = (pos == 0).nonzero().flatten().tolist()
    return starts + [pos.numel()]


def shard_batch(grid, input_ids, labels=None, position_ids=None, cu_seqlens=None, kind="zigzag"):
    """This rank's rows of a batch ([B, T] token ids, the same on every rank of the CP group) under a layout for the
    grid: a plain layout of T tokens, or a packed row (B = 1) from cu_seqlens or from position_ids that restart at
    0. labels [B, T] (usually input_ids) are shifted first (the next token of the same document; -100 at each
    document's last token), then sharded."""
    if position_ids is not None and cu_seqlens is None:
        cu_seqlens = cu_seqlens_from_position_ids(position_ids)
    T = input_ids.shape[1]
    if cu_seqlens is not None:
        if input_ids.shape[0] != 1:
            raise _seqpar.Error(f"seqpar.hf: a packed row takes batch 1, got input_ids {tuple(input_ids.shape)}")
        layout = _seqpar.SequenceLayout.packed_for_grid(grid, list(cu_seqlens), kind)
    else:
        layout = _seqpar.SequenceLayout.for_grid(grid, T, kind)
    r = grid.cp_rank
    tokens = layout.token_index(r)
    local_ids = shard_sequence(input_ids, layout, r)
    local_pos = layout.rope_positions(r)[None].expand(input_ids.shape[0], -1).contiguous()
    batch = CpBatch(layout, local_ids, local_pos)
    if labels is not None:
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        ends = torch.tensor(list(cu_seqlens)[1:] if cu_seqlens is not None else [T]) - 1
        shifted[:, ends[ends >= 0]] = -100  # the last token of every document has no next token
        pad = tokens < 0
        local = shifted.index_select(1, tokens.clamp(min=0))
        local[:, pad] = -100
        batch.shift_labels = local
        batch.num_items_in_batch = int((shifted != -100).sum())
    return batch


# ---- Qwen3-Next's gated delta net -----------------------------------------------------------------------------


def _gdn_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """Qwen3NextGatedDeltaNet.forward with the short conv and the recurrence under CP (the rest as transformers':
    projections, the head ordering, beta, g in fp32, the gated RMSNorm and the output projection)."""
    active = getattr(_state, "active", None)
    if active is None:
        return type(self).__mro__[1].forward(self, hidden_states, cache=cache, attention_mask=attention_mask,
                                              **kwargs)
    if cache is not None:
        raise _seqpar.Error("seqpar.hf: Qwen3-Next's GDN under CP runs without a cache (use_cache=False)")
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise _seqpar.Error("seqpar.hf: a 2-D attention_mask with padding is not supported under CP")
    grid, layout = active.grid, active.layout
    key = (id(grid), id(layout), active.gdn_mode)

    def make(_):
        return (_seqpar.ShortConvCp(grid, layout, _seqpar.ShortConvCpConfig(use_silu=True)),
                _seqpar.GdnCp(grid, layout, _seqpar.GdnCpConfig(mode=active.gdn_mode, use_qk_l2norm=True,
                                                                 save_inputs=False)),
                grid, layout)

    conv, gdn, _, _ = _per_module(self, "_seqpar_gdn", key, make)
    if self.activation not in ("silu", "swish"):
        raise _seqpar.Error(f"seqpar.hf: the short conv's activation is silu, the model's is {self.activation}")
    if self.conv1d.bias is not None:
        raise _seqpar.Error("seqpar.hf: a short conv with a bias is not supported")

    qkvz = self.in_proj_qkvz(hidden_states)
    ba = self.in_proj_ba(hidden_states)
    query, key_, value, z, b, a = self.fix_query_key_value_ordering(qkvz, ba)
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key_, value)], -1).contiguous()
    weight = self.conv1d.weight.squeeze(1).to(mixed.dtype).contiguous()  # [C, W]
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * torch.nn.functional.softplus(a.float() + self.dt_bias)
    if active.decoding is None:
        mixed = ShortConvFunction.apply(conv, grid, mixed, weight)
    query, key_, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], -1)
    query = query.reshape(query.shape[0], query.shape[1], -1, self.head_k_dim).contiguous()
    key_ = key_.reshape(key_.shape[0], key_.shape[1], -1, self.head_k_dim).contiguous()
    value = value.reshape(value.shape[0], value.shape[1], -1, self.head_v_dim).contiguous()
    key_, value, g, beta = (t.contiguous() for t in _in_dtype(query.dtype, key_, value, g, beta))
    if active.decoding is not None:  # generate(): q, k, v are the conv's inputs, the conv runs in GdnDecodeCp
        out = active.decoding.gdn(self, query, key_, value, g, beta, weight)
    else:
        out, _ = GdnFunction.apply(gdn, grid, query, key_, value, g, beta, None)

    z_shape = z.shape
    out = self.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
    out = out.reshape(z_shape).reshape(z_shape[0], z_shape[1], -1)
    return self.out_proj(out)


def replace_gated_delta_net(model):
    """Makes every Qwen3NextGatedDeltaNet of `model` run under CP inside context_parallel (its class is swapped for
    a subclass with _gdn_forward; parameters and state_dict unchanged). Returns the number of layers replaced."""
    from transformers.models.qwen3_next import modeling_qwen3_next as q3n

    base = q3n.Qwen3NextGatedDeltaNet
    cls = type("SeqparQwen3NextGatedDeltaNet", (base,), {"forward": _gdn_forward})
    count = 0
    for module in model.modules():
        if type(module) is base:
            module.__class__ = cls
            count += 1
    return count


# ---- generation with sharded caches ---------------------------------------------------------------------------


class _Decoding:
    """The sharded caches of one generate() call, one per attention module, and the phase (prefill or decode)."""

    def __init__(self, grid, capacity, shard, interleave):
        self.grid, self.capacity = grid, capacity
        self.decoder_options = dict(shard=shard, interleave=interleave)
        self.caches = {}  # module -> (decoder, cache)
        self.layout = None  # the prompt's, during the prefill; None during decode steps

    def gdn(self, module, q, k, v, g, beta, conv_weight):
        """A Qwen3-Next GDN layer: the prompt through GdnDecodeCp.prefill (the state and the conv tail of this
        rank's heads kept), then each step through decode; q, k, v are the conv's inputs. Returns all heads."""
        from .decode import GdnDecodeCp

        if module not in self.caches:
            if self.layout is None:
                raise _seqpar.Error("seqpar.hf.generate: a decode step reached a layer the prefill did not fill")
            dec = GdnDecodeCp(self.grid, value_heads=v.shape[2], key_heads=k.shape[2])
            self.caches[module] = (dec, dec.make_cache(q.shape[0], q.shape[3], v.shape[3], q.dtype,
                                                       conv_width=conv_weight.shape[1]))
        dec, cache = self.caches[module]
        if self.layout is not None:
            return dec.prefill(cache, self.layout, q, k, v, g, beta, conv_weight=conv_weight)
        return dec.decode(cache, q, k, v, g, beta, conv_weight=conv_weight)

    def attention(self, module, query, key, value, scaling, window, softcap, s_aux):
        if window or softcap or s_aux is not None:
            raise _seqpar.Error("seqpar.hf.generate: sliding windows, softcap and sinks have no sharded-cache decoder")
        from .decode import MhaDecodeCp

        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))  # [B, S, H, D]
        if module not in self.caches:
            if self.layout is None:
                raise _seqpar.Error("seqpar.hf.generate: a decode step reached a layer the prefill did not fill")
            dec = MhaDecodeCp(self.grid, scale=float(scaling or 0.0), **self.decoder_options)
            # the cache where the layer's keys are (transformers' caches follow the key states' device)
            self.caches[module] = (dec, dec.make_cache(k.shape[0], self.capacity, k.shape[2], k.shape[3], k.dtype,
                                                       device=k.device))
        dec, cache = self.caches[module]
        if self.layout is not None:
            out, _ = dec.prefill(cache, self.layout, q, k, v)
        else:
            out, _ = dec.decode(cache, q, k, v)
        return out


@torch.no_grad()
def generate(model, grid, input_ids, max_new_tokens, kind="zigzag", shard="interleave", interleave=1):
    """Greedy decoding of a transformers causal LM (attn_implementation="seqpar") with sharded K/V caches.

    input_ids [B, T], the same on every rank. The prompt runs under CP (each rank its rows of a `kind` layout) and
    fills each attention layer's cache, sharded by token over the ring group (seqpar.MhaDecodeCp: `shard`
    "interleave" or "contiguous"); each step then runs the model on the new token on every rank, its attention
    against the sharded caches. Qwen3-Next's GDN layers (after replace_gated_delta_net) keep the state and the short
    conv's tail of their value heads split over the CP group (seqpar.GdnDecodeCp). Returns (tokens [B, T +
    max_new_tokens], logits [B, max_new_tokens, vocab]: the logits each new token was chosen from), identical on every
    rank. Collective over the grid's CP group."""
    for module in model.modules():
        if type(module).__name__ == "Qwen3NextGatedDeltaNet":
            raise _seqpar.Error("seqpar.hf.generate: the model's GDN layers (Qwen3-Next) run under CP only after "
                                "seqpar.hf.replace_gated_delta_net(model)")
    T = input_ids.shape[1]
    decoding = _Decoding(grid, T + max_new_tokens, shard, interleave)
    batch = shard_batch(grid, input_ids, kind=kind)
    decoding.layout = batch.layout
    tokens, chosen = input_ids, []
    with context_parallel(grid, batch.layout):
        _state.active.decoding = decoding
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        last = _gather_rows(grid, batch.layout, logits)[:, T - 1]
        decoding.layout = None
        for step in range(max_new_tokens):
            chosen.append(last)
            new = last.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], 1)
            if step + 1 == max_new_tokens:
                break
            pos = torch.full_like(new, T + step)
            last = model(input_ids=new, position_ids=pos, use_cache=False).logits[:, -1]
    return tokens, torch.stack(chosen, 1)


def _gather_rows(grid, layout, local):
    from .sequence import gather_sequence

    return gather_sequence(grid, layout, local.contiguous())
