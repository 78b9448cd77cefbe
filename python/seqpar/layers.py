"""seqpar's CP layers as torch.autograd.Function and torch.nn.Module.

Every function takes this rank's piece of the sequence ([B, local_len, ...]; its rows are the tokens
layout.token_index(grid.cp_rank), padding rows -1) and returns this rank's piece of the outputs; forward and
backward are collective over the grid's CP group, so every rank of the group must call them in the same order
(autograd on CPU runs the backward on the calling thread, in the same order on every rank for the same model).
Ranks that differ on whether a backward follows (an input that requires grad, grad mode on) or on DsaCp's loss mode
stop in the forward with seqpar.Error naming the field (_agree; docs/operations.md, "Ranks that disagree").

Tensors: CPU, contiguous row-major, one floating dtype per call (fp32, bf16, fp16, fp64); they reach C++ as
DLPack views, the outputs come back the same way (no copy). A non-contiguous input is refused with seqpar.Error
naming it (call .contiguous()), and so is one with torch's negative bit (call .resolve_neg()); incoming gradients are
made contiguous and their negative bit resolved here (autograd may hand over views).

Gradients of replicated tensors. The global loss is the sum of the ranks' local losses. A sharded input gets the
gradient of its rows. A tensor that is the same on every rank of the CP group (the short conv weight, GDN's
initial_state) gets this rank's share, 1 / cp_size of the whole gradient, so that summing the parameter gradients
over the group (all_reduce, as data parallelism does) gives the exact total for every parameter alike. Outputs
that are the same on every rank (GDN's final_state, DSA's indexer loss) get their incoming gradients summed over
the group before the C++ backward.

Mixed precision (torch.autocast, fp32 master weights with bf16 activations): the modules compute in the dtype of
their first activation (q; x for the short conv) and cast the other inputs and their parameters to it (a
differentiable .to(), so each gradient comes back in its tensor's own dtype, e.g. the fp32 conv weight's); GDN's
initial_state is cast to the state dtype (fp32; fp64 for fp64). The autograd functions themselves take one dtype.

lse: -inf on padding rows (no key), as in the C++ layers; a loss on lse should skip them (a finite mask, as the
gradients already do). Double backward is not supported: a backward with create_graph=True raises seqpar.Error
instead of treating seqpar's part as a constant; so does a second backward through one forward (retain_graph=True).
"""

import re

import torch

from . import _seqpar
from . import distributed as _distributed


# Other libraries' names for a layer option (flash-attn, SDPA, fla, YunChang, transformers, DeepSeek's config): an
# option passed under one of them gets seqpar's name in the error, not pybind's list of overloads.
_FOREIGN_NAMES = {
    "window_size": "window=W (a query sees its W latest keys, itself included; flash-attn's window_size=(W - 1, 0))",
    "sliding_window": "window=W (a query sees its W latest keys, itself included)",
    "is_causal": "causal= (default True)",
    "softmax_scale": "scale= (0.0: 1 / sqrt(head dim))",
    "dropout": "dropout_p=",
    "return_attn_probs": "forward(q, k, v, return_lse=True)",
    "return_softmax_lse": "forward(q, k, v, return_lse=True)",
    "ring_impl_type": "impl='p2p' or 'allgather', and the layout's kind (zigzag by default)",
    "use_qk_l2norm_in_kernel": "use_qk_l2norm= (default True)",
    "output_final_state": "none: GdnCp returns (out, final_state) always",
    "initial_state": "forward(q, k, v, g, beta, initial_state=)",
    "cu_seqlens": "a packed layout: seqpar.SequenceLayout.packed_for_grid(grid, cu_seqlens)",
    "index_topk": "topk=",
    "kv_lora_rank": "dim_v= (the width of the latent's value part)",
}


def _make_config(name, config_cls, config, fields, extra=()):
    """The layer's config: `config` itself, or `config_cls(**fields)` (the group keywords left to resolve_grid).
    An unknown keyword raises TypeError naming seqpar's options (and seqpar's name for another library's), on every
    rank alike and before any message (the grid is resolved after)."""
    own = {k: v for k, v in fields.items() if k not in _distributed._GROUP_KEYS}
    if config is not None:
        if own:
            raise TypeError(f"{name}: pass config= or its fields, not both (got config= and {', '.join(sorted(own))})")
        return config
    known = re.findall(r"[(,]\s*(\w+):", (config_cls.__init__.__doc__ or "").split(")", 1)[0])
    known = [k for k in known if k != "self"]
    options = ", ".join(known + list(extra))
    for key in own:
        if known and key not in known:
            hint = f"; seqpar's name: {_FOREIGN_NAMES[key]}" if key in _FOREIGN_NAMES else ""
            raise TypeError(f"{name}() got an unexpected keyword argument '{key}'{hint} (its options: "
                            f"{options}, and the group keywords: {', '.join(_distributed._GROUP_KEYS)}; "
                            f"docs/python.md, \"Coming from flash-attn, flash-linear-attention or YunChang\")")
    return config_cls(**own)


def _detached(t):
    return None if t is None else t.detach()


def _grad_in(t):
    """An incoming gradient as C++ takes it: contiguous, detached, its lazy negation applied (autograd may hand over
    a torch._neg_view, whose negative bit DLPack does not carry)."""
    return t.detach().resolve_neg().contiguous()


def _backward_once(ctx):
    """Refuses a backward that builds a graph (create_graph=True): the C++ backward is not differentiable, and
    letting autograd treat it as a constant would give a wrong higher-order gradient without a word. Refuses a second
    backward through one forward (backward(retain_graph=True), then backward or torch.autograd.grad again): the C++
    backward releases the forward's saved state, so each forward serves one backward. Every rank of the group runs the
    same backward calls, so every rank raises alike, before any message."""
    if torch.is_grad_enabled():
        raise _seqpar.Error("seqpar's layers do not support double backward (a backward with create_graph=True): "
                            "their backward is not differentiable")
    if getattr(ctx, "seqpar_backward_done", False):
        raise _seqpar.Error("seqpar's layers do not support a second backward through one forward (backward with "
                            "retain_graph=True, then backward or torch.autograd.grad again): each forward's saved "
                            "state serves one backward; run the forward again for another gradient")
    ctx.seqpar_backward_done = True


def _in_dtype(dtype, *tensors):
    """Mixed precision (module docstring): the other inputs and the parameters in the activation dtype, by a
    differentiable cast (autograd returns their gradients in their own dtypes); a no-op when the dtypes agree."""
    return tuple(t.to(dtype) for t in tensors)


def _layout_hint(layout, grid, error, ndims, *tensors):
    """seqpar.Error `error` of a layer call, with the layout named when a sharded input does not have the layout's
    local_len rows (the usual cause: a torch.chunk or a hand-made split instead of seqpar.shard_sequence). The C++
    check raised it on every rank before any message; this only adds words. ndims: each tensor's number of
    dimensions; a tensor of another rank is wrong for another reason (its dim 1 is no row count), the error says so."""
    if any(t is not None and t.dim() != n for t, n in zip(tensors, ndims)):
        return error
    rows = [t.shape[1] for t in tensors if t is not None]
    if all(r == layout.local_len for r in rows):
        return error
    # [B, H, S, D] (torch's scaled_dot_product_attention order) instead of [B, S, H, D]: the rows are in dim 2
    heads_first = any(t is not None and t.dim() == 4 and t.shape[2] == layout.local_len != t.shape[1]
                      for t in tensors)
    # [S, B, H, D] (TransformerEngine's qkv_format="sbhd", Megatron's order): the rows are in dim 0
    seq_first = any(t is not None and t.dim() == 4 and t.shape[0] == layout.local_len != t.shape[1]
                    for t in tensors)
    order = (f"; a 4-D input has {layout.local_len} in dim 2: seqpar takes [B, S, H, D] (flash-attn's order), "
             "so a tensor in scaled_dot_product_attention's [B, H, S, D] needs .transpose(1, 2).contiguous()"
             if heads_first else
             f"; a 4-D input has {layout.local_len} in dim 0: seqpar takes [B, S, H, D] (TransformerEngine's "
             "qkv_format \"bshd\"), so a tensor in \"sbhd\" order [S, B, H, D] needs .transpose(0, 1).contiguous()"
             if seq_first else "")
    return _seqpar.Error(
        f"{error} [the {layout.kind} layout gives CP rank {grid.cp_rank} local_len={layout.local_len} rows "
        f"(seq_len {layout.seq_len}, padded_len {layout.padded_len} over {layout.num_ranks} ranks); got rows "
        f"{rows}: cut the sequence with seqpar.shard_sequence(x, layout, grid.cp_rank), not torch.chunk{order}]")


def _check_tensors(layer, **tensors):
    """Refuses inputs that are not torch tensors (numpy arrays, lists) before any cast or message, naming them."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise _seqpar.Error(f"{layer}: {name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")


_BACKWARD = "backward (grad mode on and an input that requires grad)"


def _backward_follows(*tensors):
    """Whether autograd will call this layer's backward: grad mode on and an input that needs a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _agree(module, call, **fields):
    """Checks that every rank of the CP group passes the same Python-side fields of a call (the C++ layer checks its
    own shapes, dtypes and configuration): ranks where one expects a backward (an input that requires grad, grad
    mode on) and another does not, or DSA's loss returned on one and trained at a weight on another, would pair a
    collective with a different one (a hang until SEQPAR_COMM_TIMEOUT_S). Cached like the C++ checks
    (SEQPAR_AGREEMENT_CHECK): a call that repeats the agreed fields sends nothing."""
    check = module.__dict__.get("_agreement")
    if check is None:
        check = module.__dict__["_agreement"] = _seqpar.AgreementCheck()
    text = {True: "yes", False: "no"}
    check.run(module.grid.cp, call, [(name, text.get(value, str(value))) for name, value in fields.items()])


def _share(total, grid):
    """This rank's share of a gradient that C++ returned in full on every rank of the CP group."""
    return total / grid.cp.size


# ---- MHA / GQA --------------------------------------------------------------------------------------------------


class MhaCpFunction(torch.autograd.Function):
    """(out, lse) = MhaCp(q, k, v): q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D]; lse [B, Hq, S_local]
    (fp32, fp64 for fp64 inputs). Both are differentiable: a loss that uses lse (e.g. a z-loss) sends its gradient
    into the backward as flash-attention does (d lse_i / d a_ij = p_ij; attn::MhaBackwardArgs::dlse). Padding rows'
    lse gradients are ignored."""

    @staticmethod
    def forward(ctx, layer, q, k, v, sinks=None, grid=None):
        out, lse, saved = layer.forward(q.detach(), k.detach(), v.detach())
        ctx.layer, ctx.saved, ctx.out_like, ctx.grid = layer, saved, (out.shape, out.dtype), grid
        ctx.set_materialize_grads(False)  # an unused lse sends no gradient (and nothing over the Ulysses group)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        _backward_once(ctx)
        if dout is None:  # a loss on lse only
            dout = torch.zeros(ctx.out_like[0], dtype=ctx.out_like[1])
        dq, dk, dv, dsinks = ctx.layer.backward(ctx.saved, _grad_in(dout), None if dlse is None else _grad_in(dlse))
        # sinks are replicated: dsinks (the whole sequence's) is the same on every rank; this rank takes its share
        dsinks = None if dsinks is None or ctx.grid is None else _share(dsinks, ctx.grid)
        return None, dq, dk, dv, dsinks, None


class MhaCp(torch.nn.Module):
    """MHA / GQA core attention under USP (Ulysses x ring; parallel/usp.h): ring attention when ulysses_size is 1
    (impl 'p2p' or 'allgather'), Ulysses when ring_size is 1; causal, sliding window, any layout.

    forward(q, k, v) -> out, or (out, lse) with return_lse. Shapes as MhaCpFunction.

    Score modifiers and dropout (docs/python.md, "Attention variants"): softcap=c (scores c tanh(s / c)),
    alibi_slopes=[Hq] tensor (bias -slope_h |i - j|; seqpar.alibi_slopes(Hq) gives Press et al.'s), sinks=[Hq]
    tensor of sink logits (a Parameter to learn them: it gets its gradient), dropout_p=p on the attention
    probabilities in training mode (module.train(); off in eval()). The dropout mask is keyed by (seed, batch,
    global head, global query and key positions), so every grid and layout drops the same pairs as one rank; the
    seed of the n-th training forward is dropout_seed + n, the same on every rank (forwards are collective)."""

    def __init__(self, grid=None, layout=None, config=None, alibi_slopes=None, sinks=None, **config_fields):
        super().__init__()
        config = _make_config("MhaCp", _seqpar.MhaCpConfig, config, config_fields, ("alibi_slopes", "sinks"))
        grid = _distributed.resolve_grid(grid, config_fields)  # or torch.distributed groups (seqpar.torch_grid)
        self.grid, self.layout = grid, _distributed.resolve_layout(grid, layout)
        self.config = config
        self.alibi_slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes).detach().contiguous()
        self.sinks = sinks  # a Parameter assigned to a Module attribute is registered
        self._num_dropout_calls = 0
        self._key = None
        self.layer = self._layer(self.config.dropout_p, self.config.dropout_seed)

    def _layer(self, dropout_p, dropout_seed):
        """The C++ layer for this call: made again when the dropout seed or the sinks' storage changed (its
        configuration holds views of the sinks and slopes)."""
        sinks = None if self.sinks is None else self.sinks.detach()
        if sinks is not None and not sinks.is_contiguous():
            raise _seqpar.Error("MhaCp: sinks must be a contiguous [Hq] tensor")
        key = (dropout_p, dropout_seed, None if sinks is None else (sinks.data_ptr(), sinks.dtype))
        if key != self._key:
            c = self.config
            config = _seqpar.MhaCpConfig(c.impl, c.causal, c.window, c.scale, c.softcap, dropout_p, dropout_seed)
            config.set_score_tensors(self.alibi_slopes, sinks)
            self._config_tensors = (self.alibi_slopes, sinks)  # alive as long as the layer
            self.layer, self._key = _seqpar.MhaCp(self.grid, self.layout, config), key
        return self.layer

    def forward(self, q, k, v, return_lse=False):
        _check_tensors("MhaCp", q=q, k=k, v=v)
        p = self.config.dropout_p if self.training else 0.0
        seed = self.config.dropout_seed
        if p > 0:
            seed += self._num_dropout_calls
            self._num_dropout_calls += 1
        layer = self._layer(p, seed)
        _agree(self, "MhaCp (Python)", **{_BACKWARD: _backward_follows(q, k, v, self.sinks)})
        k, v = _in_dtype(q.dtype, k, v)
        try:
            out, lse = MhaCpFunction.apply(layer, q, k, v, self.sinks, self.grid)
        except _seqpar.Error as e:
            raise _layout_hint(self.layout, self.grid, e, (4, 4, 4), q, k, v) from None
        return (out, lse) if return_lse else out


# ---- GDN and the short conv ------------------------------------------------------------------------------------


class GdnFunction(torch.autograd.Function):
    """(out, final_state) = gated delta rule over the whole sharded sequence (parallel/gdn_cp.h).

    q, k [B, S_local, Hk, K], v [B, S_local, Hv, V], g (log decay), beta [B, S_local, Hv]; initial_state None or
    [B, Hv, K, V] in the state dtype (fp32; fp64 for fp64 inputs), the same on every rank. out [B, S_local, Hv, V];
    final_state [B, Hv, K, V] (state dtype), the same on every rank."""

    @staticmethod
    def forward(ctx, layer, grid, q, k, v, g, beta, initial_state):
        inputs = tuple(t.detach() for t in (q, k, v, g, beta))
        out, final_state, saved = layer.forward(*inputs, _detached(initial_state))
        ctx.layer, ctx.grid, ctx.saved = layer, grid, saved
        ctx.has_initial_state = initial_state is not None
        # The layer keeps no copies of q, k, v, g, beta (save_inputs False): ctx holds them for its backward. Not
        # through save_for_backward, whose tensors activation checkpointing drops and recomputes (which would run the
        # collective forwards before this one again); their versions stand in for its in-place check.
        ctx.inputs, ctx.versions = inputs, tuple(t._version for t in inputs)
        return out, final_state

    @staticmethod
    def backward(ctx, dout, dfinal_state):
        _backward_once(ctx)
        changed = next((f"{name} was modified in place after the forward (version {version} -> {t._version})"
                        for name, t, version in zip(("q", "k", "v", "g", "beta"), ctx.inputs, ctx.versions)
                        if t._version != version), None)
        # final_state is replicated: the whole loss's gradient is the sum of the ranks' (module docstring). One more
        # element counts the ranks whose inputs changed in place, so that every rank refuses alike, before the
        # layer's own messages.
        d = _grad_in(dfinal_state)
        summed = torch.cat([d.reshape(-1), d.new_tensor([1.0 if changed else 0.0])])
        ctx.grid.cp.all_reduce(summed)
        if summed[-1] > 0:
            raise _seqpar.Error(f"GdnCp backward: {changed or 'an input of another rank (q, k, v, g or beta)'}"
                                f"{'' if changed else ' was modified in place after the forward'}; the layer reads "
                                "its inputs again in the backward")
        dfinal_state = summed[:-1].view(d.shape)
        dq, dk, dv, dg, dbeta, dinitial = ctx.layer.backward(ctx.saved, _grad_in(dout), dfinal_state, ctx.inputs)
        ctx.inputs = None
        dinitial = _share(dinitial, ctx.grid) if ctx.has_initial_state else None
        return None, None, dq, dk, dv, dg, dbeta, dinitial


class GdnCp(torch.nn.Module):
    """Gated delta rule under context parallelism: state passing 'chain' or 'scan' over the ring group, heads
    over the Ulysses group (parallel/gdn_cp.h). forward(q, k, v, g, beta, initial_state=None) -> (out, final_state);
    shapes as GdnFunction."""

    def __init__(self, grid=None, layout=None, config=None, **config_fields):
        super().__init__()
        config = _make_config("GdnCp", _seqpar.GdnCpConfig, config, config_fields)
        grid = _distributed.resolve_grid(grid, config_fields)  # or torch.distributed groups (seqpar.torch_grid)
        self.grid, self.layout = grid, _distributed.resolve_layout(grid, layout)
        self.config = config
        # autograd saves q, k, v, g, beta for GdnFunction's backward: the layer keeps no copies of its own
        layer_config = _seqpar.GdnCpConfig(mode=config.mode, use_qk_l2norm=config.use_qk_l2norm, scale=config.scale,
                                           chunk_size=config.chunk_size, save_inputs=False)
        self.layer = _seqpar.GdnCp(grid, self.layout, layer_config)

    def forward(self, q, k, v, g, beta, initial_state=None):
        _check_tensors("GdnCp", q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
        _agree(self, "GdnCp (Python)", **{_BACKWARD: _backward_follows(q, k, v, g, beta, initial_state)})
        k, v, g, beta = _in_dtype(q.dtype, k, v, g, beta)
        if initial_state is not None:
            initial_state = initial_state.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        try:
            return GdnFunction.apply(self.layer, self.grid, q, k, v, g, beta, initial_state)
        except _seqpar.Error as e:
            raise _layout_hint(self.layout, self.grid, e, (4, 4, 4, 3, 3), q, k, v, g, beta) from None


class ShortConvFunction(torch.autograd.Function):
    """out = silu(causal depthwise conv(x)) over the sharded sequence (halo exchange over the CP group).
    x [B, S_local, C], weight [C, W] (the same on every rank; weight[:, W-1] multiplies the current token)."""

    @staticmethod
    def forward(ctx, layer, grid, x, weight):
        out, saved = layer.forward(x.detach(), weight.detach())
        ctx.layer, ctx.grid, ctx.saved = layer, grid, saved
        ctx.weight_meta = (weight.shape, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        _backward_once(ctx)
        dweight = torch.empty(ctx.weight_meta[0], dtype=ctx.weight_meta[1])
        dx = ctx.layer.backward(ctx.saved, _grad_in(dout), dweight)  # dweight: summed over the CP group
        return None, None, dx, _share(dweight, ctx.grid)


class ShortConvCp(torch.nn.Module):
    """The short causal depthwise conv before GDN's q, k, v (Qwen3-Next), with its weight [channels, width].
    forward(x [B, S_local, channels]) -> [B, S_local, channels]."""

    def __init__(self, grid=None, layout=None, channels=None, width=4, use_silu=True, dtype=torch.float32, **groups):
        super().__init__()
        grid = _distributed.resolve_grid(grid, groups)  # or torch.distributed groups (seqpar.torch_grid)
        if groups or channels is None:
            raise _seqpar.Error(f"ShortConvCp: needs channels=; unknown arguments {sorted(groups)}")
        for name, value in (("channels", channels), ("width", width)):
            if isinstance(value, bool) or not hasattr(value, "__index__") or value < 1:
                raise _seqpar.Error(f"ShortConvCp: {name}={value!r} must be an int >= 1")
        self.grid, self.layout = grid, _distributed.resolve_layout(grid, layout)
        self.layer = _seqpar.ShortConvCp(grid, self.layout, _seqpar.ShortConvCpConfig(use_silu=use_silu))
        bound = 1.0 / width**0.5  # torch.nn.Conv1d's default init for a depthwise conv (fan_in = width)
        self.weight = torch.nn.Parameter(torch.empty(channels, width, dtype=dtype).uniform_(-bound, bound))

    def forward(self, x):
        _check_tensors("ShortConvCp", x=x)
        _agree(self, "ShortConvCp (Python)", **{_BACKWARD: _backward_follows(x, self.weight)})
        try:
            return ShortConvFunction.apply(self.layer, self.grid, x, self.weight.to(x.dtype))
        except _seqpar.Error as e:
            raise _layout_hint(self.layout, self.grid, e, (3,), x) from None


# ---- DSA --------------------------------------------------------------------------------------------------------


def _keep_topk(topk_out, layer, topk):
    """DsaCp(return_topk_indices=True): the layer's selection, its slot positions rewritten as token indices of the
    row (-1 padded), appended to the list `topk_out` (None: not asked for)."""
    if topk_out is not None:
        _seqpar.dsa_topk_slots_to_tokens(layer.layout, topk)
        topk_out.append(topk)


class DsaFunction(torch.autograd.Function):
    """(out, indexer_loss) = DeepSeek sparse attention over the sharded sequence (parallel/dsa_cp.h).

    q [B, S_local, H, Dqk], c [B, S_local, Dqk] (the latent), q_idx [B, S_local, Hi, Di], k_idx [B, S_local, Di],
    w [B, S_local, Hi]; out [B, S_local, H, Dv]. indexer_loss: the KL loss of the indexer summed over the whole
    sequence, a 0-d fp64 tensor, the same on every rank; its gradient (summed over the CP group) flows into q_idx,
    k_idx and w only, and out's only into q and c.

    The C++ layer computes the loss in its backward. To return it from the forward, the forward runs the layer's
    forward and backward once (with a zero dout) for the loss value, and a second forward for the context of the
    real backward: about twice the cost of the layer. DsaCp(indexer_loss_weight=w) avoids it. The
    loss's incoming gradient reaches C++ as a double (loss_grad_scale): exact in fp64; fp32 kernels apply its fp32
    rounding.
    """

    @staticmethod
    def forward(ctx, layer, grid, q, c, q_idx, k_idx, w, topk_out=None):
        inputs = (q.detach(), c.detach(), q_idx.detach(), k_idx.detach(), w.detach())
        out, _, _, probe = layer.forward(*inputs)
        loss = layer.backward(probe, torch.zeros_like(out), 0.0)[5]
        out, _, topk, saved = layer.forward(*inputs)
        ctx.layer, ctx.grid, ctx.saved = layer, grid, saved
        _keep_topk(topk_out, layer, topk)
        return out, torch.tensor(loss, dtype=torch.float64)

    @staticmethod
    def backward(ctx, dout, dloss):
        _backward_once(ctx)
        dloss = _grad_in(dloss).reshape(1).clone()
        ctx.grid.cp.all_reduce(dloss)
        dq, dc, dq_idx, dk_idx, dw, _ = ctx.layer.backward(ctx.saved, _grad_in(dout), float(dloss))
        return None, None, dq, dc, dq_idx, dk_idx, dw, None


class DsaWeightedFunction(torch.autograd.Function):
    """out = DSA(q, c, q_idx, k_idx, w) with the indexer loss trained at a fixed weight in one forward and one
    backward (the loss value is not returned): the indexer inputs get weight * d(indexer loss)."""

    @staticmethod
    def forward(ctx, layer, weight, q, c, q_idx, k_idx, w, topk_out=None):
        out, _, topk, saved = layer.forward(q.detach(), c.detach(), q_idx.detach(), k_idx.detach(), w.detach())
        ctx.layer, ctx.weight, ctx.saved = layer, weight, saved
        _keep_topk(topk_out, layer, topk)
        return out

    @staticmethod
    def backward(ctx, dout):
        _backward_once(ctx)
        dq, dc, dq_idx, dk_idx, dw, _ = ctx.layer.backward(ctx.saved, _grad_in(dout), ctx.weight)
        return None, None, dq, dc, dq_idx, dk_idx, dw, None


class DsaCp(torch.nn.Module):
    """DeepSeek sparse attention under context parallelism (parallel/dsa_cp.h); shapes as DsaFunction.

    forward(q, c, q_idx, k_idx, w) -> (out, indexer_loss) by default; with indexer_loss_weight=x -> out, the indexer
    trained with x * its loss (one pass, no loss value). With return_topk_indices=True the selection is appended:
    (out, indexer_loss, topk_indices) or (out, topk_indices), topk_indices [B, S_local, topk] int64, the selected
    keys of each of this rank's queries as token indices of the row (cu_seqlens' row when packed), -1 padded where a
    query has fewer than topk visible keys; not differentiable."""

    def __init__(self, grid=None, layout=None, config=None, indexer_loss_weight=None, return_topk_indices=False,
                 **config_fields):
        super().__init__()
        config = _make_config("DsaCp", _seqpar.DsaCpConfig, config, config_fields,
                              ("indexer_loss_weight", "return_topk_indices"))
        grid = _distributed.resolve_grid(grid, config_fields)  # or torch.distributed groups (seqpar.torch_grid)
        self.grid, self.layout = grid, _distributed.resolve_layout(grid, layout)
        self.config = config
        if indexer_loss_weight is not None:
            try:
                indexer_loss_weight = float(indexer_loss_weight)
            except (TypeError, ValueError):
                raise _seqpar.Error(f"DsaCp: indexer_loss_weight={indexer_loss_weight!r} must be a number (None: "
                                    f"return the indexer loss)") from None
            if indexer_loss_weight != indexer_loss_weight or abs(indexer_loss_weight) == float("inf"):
                raise _seqpar.Error(f"DsaCp: indexer_loss_weight={indexer_loss_weight} must be finite")
        self.indexer_loss_weight = indexer_loss_weight
        if not isinstance(return_topk_indices, bool):
            raise _seqpar.Error(f"DsaCp: return_topk_indices={return_topk_indices!r} must be True or False")
        self.return_topk_indices = return_topk_indices
        self.layer = _seqpar.DsaCp(grid, self.layout, self.config)

    def forward(self, q, c, q_idx, k_idx, w):
        _check_tensors("DsaCp", q=q, c=c, q_idx=q_idx, k_idx=k_idx, w=w)
        loss = "returned" if self.indexer_loss_weight is None else f"trained at weight {self.indexer_loss_weight!r}"
        _agree(self, "DsaCp (Python)", **{_BACKWARD: _backward_follows(q, c, q_idx, k_idx, w)}, indexer_loss=loss)
        c, q_idx, k_idx, w = _in_dtype(q.dtype, c, q_idx, k_idx, w)
        topk = [] if self.return_topk_indices else None
        try:
            if self.indexer_loss_weight is None:
                result = DsaFunction.apply(self.layer, self.grid, q, c, q_idx, k_idx, w, topk)
            else:
                result = DsaWeightedFunction.apply(self.layer, float(self.indexer_loss_weight), q, c, q_idx, k_idx,
                                                   w, topk)
            if topk is None:
                return result
            return (*result, topk[0]) if isinstance(result, tuple) else (result, topk[0])
        except _seqpar.Error as e:
            raise _layout_hint(self.layout, self.grid, e, (4, 3, 4, 3, 3), q, c, q_idx, k_idx, w) from None
