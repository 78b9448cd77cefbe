"""seqpar.hf: tiny transformers models (configs in code, random weights, nothing downloaded) under seqpar CP against
the same model on one process without seqpar (attn_implementation "eager", transformers' own GDN), forward (logits,
the loss) and backward (every parameter's gradient summed over the CP group), in fp32.

Llama and Qwen3 (GQA, RoPE at the layout's positions, causal; plain rows with padding slots, and packed rows from
position_ids) at every (ulysses_size, ring_size) of the world (ring, USP, Ulysses); Qwen3-Next's hybrid stack (3 GDN
layers with the short conv, 1 gated attention layer) likewise. transformers is installed by name by
scripts/common.sh for these tests only; without it they are skipped."""

import copy

import pytest
import torch

try:
    import transformers
except ImportError as e:  # not installed, or installed without what it needs
    pytest.skip(f"transformers does not import ({e}); scripts/common.sh pip-installs it for these tests (pip install "
                "transformers)", allow_module_level=True)

import launch  # noqa: E402
import seqpar  # noqa: E402
import seqpar.hf  # noqa: E402
from references import check_close, usp_grids  # noqa: E402

WORLD = launch.world_size()
VOCAB = 64
# fp32 end to end on both sides; different summation orders (blockwise online softmax, chunked GDN) over 2-4
# layers: errors of a few 1e-6 relative to max(1, |reference|).
RTOL = 2e-5

seqpar.hf.register()


def tiny_config(kind):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaConfig(num_hidden_layers=2, **common)
    if kind == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, **common)
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(
            num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
            linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            mlp_only_layers=[0, 1, 2, 3],  # dense MLPs: a router tie flipped by rounding would not be CP's error
            **common)
    raise ValueError(kind)


def models(kind):
    """(reference, seqpar) models with the same random weights."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager")
    with torch.no_grad():  # larger weights than the tiny init, so that attention is far from uniform
        for p in ref.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    cp = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="seqpar")
    cp.load_state_dict(ref.state_dict())
    if kind == "qwen3_next":
        assert seqpar.hf.replace_gated_delta_net(cp) == 3
    return ref.float(), cp.float()


def shifted_labels(ids, cu_seqlens):
    """Next-token labels, -100 at the last token of every document (independent of seqpar.hf.shard_batch)."""
    out = torch.full_like(ids, -100)
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out[:, a:b - 1] = ids[:, a + 1:b]
    return out


def run_and_compare(kind, grid, ids, position_ids=None, cu_seqlens=None, layout="zigzag"):
    ref, cp = models(kind)
    T = ids.shape[1]
    cu = cu_seqlens if cu_seqlens is not None else [0, T]
    labels = shifted_labels(ids, cu)
    full_pos = position_ids if position_ids is not None else torch.arange(T)[None].expand(ids.shape[0], -1)

    logits = ref(input_ids=ids, position_ids=full_pos, use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                 reduction="sum") / int((labels != -100).sum())
    ref_loss.backward()

    batch = seqpar.hf.shard_batch(grid, ids, labels=ids, position_ids=position_ids,
                                  cu_seqlens=cu_seqlens if position_ids is None else None, kind=layout)
    with seqpar.hf.context_parallel(grid, batch.layout):
        out = cp(**batch.model_kwargs())
    out.loss.backward()

    tokens = batch.layout.token_index(grid.cp_rank)
    real = (tokens >= 0).nonzero().flatten()
    check_close("logits", out.logits.index_select(1, real), logits.index_select(1, tokens.index_select(0, real)),
                RTOL)
    assert torch.equal(batch.shift_labels.index_select(1, real), labels.index_select(1, tokens.index_select(0, real)))
    loss = out.loss.detach().reshape(1).clone()
    grid.cp.all_reduce(loss)
    check_close("loss (summed over the CP group)", loss[0], ref_loss, RTOL)
    ref_params = dict(ref.named_parameters())
    for name, p in cp.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grad = p.grad.clone()
        grid.cp.all_reduce(grad)
        check_close(f"grad of {name}", grad, ref_params[name].grad, RTOL)


GRIDS = usp_grids(WORLD)


@pytest.mark.parametrize("grid_shape", GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_causal_lm_matches_one_process(kind, grid_shape, layout):
    grid = launch.grid(*grid_shape)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 37))  # 37 tokens: padding slots under every layout and grid
    run_and_compare(kind, grid, ids, layout=layout)


@pytest.mark.parametrize("grid_shape", GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_packed_rows_from_position_ids(kind, grid_shape):
    """One row of three documents marked by position_ids restarting at 0 (transformers' packed format): the
    reference model masks across documents from the same position_ids."""
    grid = launch.grid(*grid_shape)
    torch.manual_seed(2)
    cu = [0, 11, 26, 41]
    ids = torch.randint(0, VOCAB, (1, cu[-1]))
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
    assert seqpar.hf.cu_seqlens_from_position_ids(pos) == cu
    run_and_compare(kind, grid, ids, position_ids=pos, cu_seqlens=cu)


@pytest.mark.parametrize("grid_shape", GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_qwen3_next_hybrid_matches_one_process(grid_shape):
    grid = launch.grid(*grid_shape)
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 48))
    run_and_compare("qwen3_next", grid, ids)


@pytest.mark.parametrize("grid_shape", GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_padded_attention_mask_is_refused_on_every_rank(grid_shape):
    """A 2-D attention_mask with zeros (left padding) is refused, not ignored (transformers passes no mask to an
    implementation without a mask function, so padded tokens would be attended to as real ones); a rank alone with a
    padded mask stops every rank; a mask of ones gives the logits of no mask."""
    grid = launch.grid(*grid_shape)
    _, cp = models("llama")
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    batch = seqpar.hf.shard_batch(grid, ids)
    padded = torch.ones(1, 12, dtype=torch.long)
    padded[:, :4] = 0
    ones = torch.ones_like(padded)

    def run(mask):
        return cp(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask,
                  use_cache=False).logits

    with torch.no_grad(), seqpar.hf.context_parallel(grid, batch.layout):
        with pytest.raises(seqpar.Error, match="attention_mask with padding is not supported under CP"):
            run(padded)
        if grid.cp.size > 1:
            with pytest.raises(seqpar.Error, match="attention_mask"):
                run(padded if grid.cp_rank == 0 else ones)
        check_close("logits with a mask of ones", run(ones), run(None), 0.0)


def test_without_context_is_refused_and_gdn_falls_back():
    """attn_implementation='seqpar' outside context_parallel raises naming the fix; a replaced GDN layer outside
    the context runs transformers' code (equal to the unreplaced layer)."""
    _, cp = models("llama")
    with pytest.raises(seqpar.Error, match="context_parallel"):
        cp(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
    cfg = tiny_config("qwen3_next")
    torch.manual_seed(0)
    layer = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0)
    replaced = copy.deepcopy(layer)

    class Holder(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

    assert seqpar.hf.replace_gated_delta_net(Holder(replaced)) == 1
    x = torch.randn(1, 8, 32)
    check_close("fallback", replaced(x), layer(x), 0.0)


@pytest.mark.parametrize("grid_shape", GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_generate_with_sharded_caches(kind, grid_shape):
    """Greedy decoding with the K/V caches sharded over the ring group: the logits of every step equal the one-process
    model's over the generated sequence, and the tokens equal transformers' own generate()."""
    grid = launch.grid(*grid_shape)
    ref, cp = models(kind)
    torch.manual_seed(4)
    T, N = 21, 6
    ids = torch.randint(0, VOCAB, (2, T))
    tokens, logits = seqpar.hf.generate(cp, grid, ids, max_new_tokens=N)
    full = ref(input_ids=tokens, use_cache=False).logits
    check_close("logits of each step", logits, full[:, T - 1:T - 1 + N], RTOL)
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                        pad_token_id=0)
    assert torch.equal(tokens, want), f"tokens {tokens.tolist()} != transformers' {want.tolist()}"


@pytest.mark.parametrize("grid_shape", GRIDS, ids=lambda g: f"u{g[0]}r{g[1]}")
def test_qwen3_next_generate(grid_shape):
    """The hybrid stack: GDN layers decode from their head-split state and conv tail, the attention layer from its
    sharded K/V cache; every step's logits equal the one-process model's over the generated sequence."""
    grid = launch.grid(*grid_shape)
    ref, cp = models("qwen3_next")
    torch.manual_seed(5)
    T, N = 19, 5
    ids = torch.randint(0, VOCAB, (1, T))
    tokens, logits = seqpar.hf.generate(cp, grid, ids, max_new_tokens=N)
    full = ref(input_ids=tokens, use_cache=False).logits
    check_close("logits of each step", logits, full[:, T - 1:T - 1 + N], RTOL)
    assert torch.equal(tokens[:, T:], full[:, T - 1:T - 1 + N].argmax(-1))


def test_generate_refuses_unreplaced_gdn():
    grid = launch.grid(1, WORLD)
    ref, _ = models("qwen3_next")
    with pytest.raises(seqpar.Error, match="replace_gated_delta_net"):
        seqpar.hf.generate(ref, grid, torch.zeros(1, 8, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_autocast_bf16_with_fp32_weights(kind):
    """torch.autocast bf16 over fp32 weights through seqpar's attention, conv and GDN: logits in bf16 whose error
    against the fp32 one-process model is no larger than transformers' own under the same autocast (bf16 rounding
    through 2-4 layers, weights scaled up: about 0.1 here), and fp32 gradients for every parameter."""
    grid = launch.grid(1, WORLD)
    ref, cp = models(kind)
    torch.manual_seed(6)
    ids = torch.randint(0, VOCAB, (1, 40))
    batch = seqpar.hf.shard_batch(grid, ids, labels=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16), seqpar.hf.context_parallel(grid, batch.layout):
        out = cp(**batch.model_kwargs())
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in cp.parameters())
    with torch.no_grad():
        full = ref(input_ids=ids, use_cache=False).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hf_bf16 = ref(input_ids=ids, use_cache=False).logits.float()
    got = seqpar.gather_sequence(grid, batch.layout, out.logits.float().contiguous())
    err, hf_err = (got - full).abs().max().item(), (hf_bf16 - full).abs().max().item()
    assert err <= 1.5 * hf_err + 1e-2, f"seqpar under autocast: max error {err:.3g}; transformers alone: {hf_err:.3g}"
