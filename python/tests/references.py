"""Whole-sequence references written in PyTorch (autograd gives their gradients), and the harness that runs a
seqpar layer on this rank's piece of the same problem and compares with them."""

import itertools
import math

import torch
import torch.nn.functional as F

import seqpar


def same_document(S, cu_seqlens=None):
    """[S, S] bool: tokens i and j lie in the same document of cu_seqlens (all True without one)."""
    if cu_seqlens is None:
        return torch.ones(S, S, dtype=torch.bool)
    doc = torch.bucketize(torch.arange(S), torch.as_tensor(cu_seqlens)[1:], right=True)
    return doc[:, None] == doc[None, :]


def mha_reference(q, k, v, causal=True, window=0, scale=0.0, cu_seqlens=None):
    """Materialised softmax attention, GQA by repeating each kv head over its Hq / Hkv query heads; with cu_seqlens
    (a packed row) a query sees the keys of its own document only."""
    S, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    rep = Hq // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scale = scale if scale > 0 else 1.0 / math.sqrt(D)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = same_document(S, cu_seqlens)
    if causal:
        visible &= j <= i
    if window > 0:
        visible &= i - j < window
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def gdn_reference(q, k, v, g, beta, initial_state=None, scale=0.0, use_qk_l2norm=True):
    """The gated delta rule token by token: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T q_t; value head h reads key head h / (Hv / Hk)."""
    B, S, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    q, k = q.repeat_interleave(Hv // Hk, 2), k.repeat_interleave(Hv // Hk, 2)
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (scale if scale > 0 else 1.0 / math.sqrt(K))
    state = initial_state if initial_state is not None else torch.zeros(B, Hv, K, V, dtype=q.dtype)
    outs = []
    for t in range(S):
        kt, vt = k[:, t], v[:, t]
        bt, decay = beta[:, t][..., None, None], torch.exp(g[:, t])[..., None, None]
        ks = torch.einsum("bhk,bhkv->bhv", kt, state)
        state = decay * (state - bt * kt[..., :, None] * ks[..., None, :]) + bt * kt[..., :, None] * vt[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    out = torch.stack(outs, 1) if outs else q.new_zeros(B, 0, Hv, V)  # an empty document
    return out, state


def gdn_packed_reference(q, k, v, g, beta, initial_state, cu_seqlens, scale=0.0, use_qk_l2norm=True):
    """gdn_reference on each document of a packed row ([1, T, ...]) alone from its own initial_state[d]
    ([N, Hv, K, V]); the outputs concatenated, the final states stacked [N, Hv, K, V]."""
    outs, finals = [], []
    for d in range(len(cu_seqlens) - 1):
        lo, hi = cu_seqlens[d], cu_seqlens[d + 1]
        out, final = gdn_reference(*(t[:, lo:hi] for t in (q, k, v, g, beta)), initial_state[d:d + 1], scale,
                                   use_qk_l2norm)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, 1), torch.cat(finals, 0)


def short_conv_reference(x, weight, use_silu=True):
    """Causal depthwise conv: y[t, c] = sum_w weight[c, w] x[t - (W-1) + w, c] (zeros before the start)."""
    W = weight.shape[1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight[:, None, :], groups=x.shape[2]).transpose(1, 2)
    return F.silu(y) if use_silu else y


def dsa_reference(q, c, q_idx, k_idx, w, topk, dim_v, scale=0.0, window=0):
    """Dense DSA: indexer scores of every visible key, the top-k (larger score first, then the smaller position:
    relu makes exact ties at 0 common), softmax attention over the selected latents, and the indexer's KL loss against
    the head-summed attention probabilities."""
    S, Dqk = q.shape[1], q.shape[3]
    scores = (torch.einsum("bthd,bjd->bthj", q_idx, k_idx).relu() * w[..., None]).sum(2)  # [B, S, S]
    t, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = j <= t
    if window > 0:
        visible &= t - j < window
    masked = scores.masked_fill(~visible, float("-inf"))
    kk = min(topk, S)
    chosen = masked.detach().sort(dim=-1, descending=True, stable=True).indices[..., :kk]  # stable: smaller position
    valid = torch.arange(kk) < visible.sum(-1, keepdim=True)
    selected = torch.zeros_like(masked, dtype=torch.bool).scatter(-1, chosen, valid.expand_as(chosen))
    scale = scale if scale > 0 else 1.0 / math.sqrt(Dqk)
    logits = torch.einsum("bthd,bjd->bhtj", q, c) * scale
    p = logits.masked_fill(~selected[:, None], float("-inf")).softmax(-1)
    out = torch.einsum("bhtj,bjd->bthd", p, c[..., :dim_v])
    target = p.detach().sum(1)
    target = target / target.sum(-1, keepdim=True)
    log_q = scores.masked_fill(~selected, float("-inf")).log_softmax(-1)
    loss = torch.where(selected, torch.xlogy(target, target) - target * log_q.masked_fill(~selected, 0), 0).sum()
    return out, loss


def usp_grids(world_size):
    """(ulysses_size, ring_size) of every factorisation of the world."""
    return [(u, world_size // u) for u in range(1, world_size + 1) if world_size % u == 0]


def random_full(shape, dtype=torch.float64, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def _rank():
    """This process's rank: torch.distributed's under torchrun (MPI is not initialised there), else the MPI world's."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else seqpar.world().rank


def check_close(name, got, want, rtol):
    """max |got - want| <= rtol * max(1, max |want|); the message names the tensor, the worst index and both values."""
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs()
    bound = rtol * max(1.0, want.abs().max().item())
    worst = int(err.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    assert err.max().item() <= bound, (
        f"rank {_rank()}: {name}[{idx}] = {got.flatten()[worst].item()!r}, reference "
        f"{want.flatten()[worst].item()!r} (max error {err.max().item():.3g} > {bound:.3g})")


def run_against_reference(grid, layout, full_sharded, full_replicated, layer, reference, rtol, seed=1):
    """Runs `layer` on this rank's pieces and `reference` on the whole sequence, forward and backward.

    full_sharded: [B, T, ...] leaf tensors (fp64 or the tested dtype), cut by the layout (padding rows zero, their
    outputs not compared); full_replicated: tensors
    the same on every rank (or None). layer(*local_sharded, *replicated) -> (sharded outputs, replicated outputs);
    reference(*full_sharded, *replicated) -> the same outputs for the whole sequence, in fp64.
    The loss is sum(out * dout) over every output with random dout; each rank adds its rows, and replicated outputs
    once over the group (1 / cp_size each). Checks every output's rows and every input's gradient (the gradients
    summed over the CP group, the way a training step sums parameter gradients).
    """
    tokens = layout.token_index(grid.cp_rank)  # per local row; -1 for a padding row
    real_rows = (tokens >= 0).nonzero().flatten()
    real_tokens = tokens.index_select(0, real_rows)
    ref_inputs = [t.detach().to(torch.float64).requires_grad_() for t in full_sharded]
    ref_repl = [None if t is None else t.detach().to(torch.float64).requires_grad_() for t in full_replicated]
    ref_sharded_out, ref_repl_out = reference(*ref_inputs, *ref_repl)
    gen = torch.Generator().manual_seed(seed)
    douts = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in ref_sharded_out]
    # fp32-representable values (DSA's loss gradient, DsaCp::backward's loss_grad_scale, a double)
    drepl = [torch.randn(o.shape, generator=gen).to(torch.float64) for o in ref_repl_out]
    ref_loss = sum((o * d).sum() for o, d in zip(ref_sharded_out, douts))
    ref_loss = ref_loss + sum((o * d).sum() for o, d in zip(ref_repl_out, drepl))
    ref_loss.backward()

    local = [seqpar.shard_sequence(t, layout, grid.cp_rank) for t in full_sharded]
    sharded_out, repl_out = layer(*local, *full_replicated)
    n = grid.cp.size
    loss = sum((o.to(torch.float64) * seqpar.shard_sequence(d, layout, grid.cp_rank)).sum()
               for o, d in zip(sharded_out, douts))  # zero dout on padding rows
    loss = loss + sum((o.to(torch.float64) * d).sum() / n for o, d in zip(repl_out, drepl))
    loss.backward()

    for i, (o, r) in enumerate(zip(sharded_out, ref_sharded_out)):
        check_close(f"out{i}", o.index_select(1, real_rows), r.index_select(1, real_tokens), rtol)
    for i, (o, r) in enumerate(zip(repl_out, ref_repl_out)):
        check_close(f"replicated out{i}", o, r, rtol)
    for i, (t, r) in enumerate(itertools.chain(zip(full_sharded, ref_inputs), zip(full_replicated, ref_repl))):
        if t is None:
            continue
        grad = t.grad.clone()
        grid.cp.all_reduce(grad)
        check_close(f"grad of input {i}", grad, r.grad, rtol)
