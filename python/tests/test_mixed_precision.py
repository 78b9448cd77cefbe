"""Mixed precision: fp32 master weights with bf16 activations (torch.autocast on the CPU) through the short conv, GDN
and MHA, against the same model in fp32, at bf16 tolerance; each parameter's gradient comes back in fp32."""

import torch
import torch.nn.functional as F

import seqpar
from references import check_close, gdn_reference, mha_reference, short_conv_reference

WORLD = seqpar.world().size
B, S, HK, HV, K, V, W = 1, 48, 2, 4, 8, 8, 4
C = 2 * HK * K + HV * V
# bf16 rounds each activation to 8 bits; errors relative to max(1, max |reference|), through a conv, a recurrence
# over 48 tokens and a projection.
RTOL_BF16 = 5e-2


class GdnBlock(torch.nn.Module):
    """Qwen3-Next's linear-attention core: a projection to [q | k | v], the short conv, g in fp32 from learned
    parameters, beta, the gated delta rule, an output projection. conv and gdn: seqpar's, or torch references."""

    def __init__(self, grid, layout, d_model=16):
        super().__init__()
        self.proj = torch.nn.Linear(d_model, C + 2 * HV)
        self.conv = seqpar.ShortConvCp(grid, layout, C, W) if grid is not None else None
        self.conv_weight = self.conv.weight if self.conv is not None else torch.nn.Parameter(torch.empty(C, W))
        self.A_log = torch.nn.Parameter(torch.rand(HV))
        self.gdn = seqpar.GdnCp(grid, layout) if grid is not None else None
        self.out = torch.nn.Linear(HV * V, d_model)

    def forward(self, x):
        h = self.proj(x)
        mixed, a, b = h.split([C, HV, HV], -1)
        if self.conv is not None:
            mixed = self.conv(mixed.contiguous())
        else:
            mixed = short_conv_reference(mixed, self.conv_weight)
        q, k, v = mixed.split([HK * K, HK * K, HV * V], -1)
        q, k, v = (t.unflatten(-1, (h, d)).contiguous() for t, h, d in ((q, HK, K), (k, HK, K), (v, HV, V)))
        g = (-self.A_log.float().exp() * F.softplus(a.float())).contiguous()  # fp32, as Qwen3-Next computes it
        beta = b.sigmoid().contiguous()
        if self.gdn is not None:
            o, _ = self.gdn(q, k, v, g, beta)
        else:
            o, _ = gdn_reference(q, k, v, g.to(q.dtype), beta)
        return self.out(o.flatten(2))


def test_gdn_block_autocast_bf16_with_fp32_weights():
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    torch.manual_seed(1)
    model = GdnBlock(grid, layout)
    ref = GdnBlock(None, None)
    with torch.no_grad():
        for p, rp in zip(model.parameters(), ref.parameters()):  # the same order: proj, conv, A_log, out
            rp.copy_(p)
    x = torch.randn(B, S, 16)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(seqpar.shard_sequence(x, layout, grid.cp_rank))
    assert out.dtype == torch.bfloat16
    dout = torch.randn(B, S, 16)
    (out.float() * seqpar.shard_sequence(dout, layout, grid.cp_rank)).sum().backward()

    ref = ref.double()
    want = ref(x.double())
    (want * dout.double()).sum().backward()
    check_close("out", seqpar.gather_sequence(grid, layout, out.float()), want, RTOL_BF16)
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.dtype == torch.float32, f"{name}: gradient dtype {p.grad.dtype}"
        grad = p.grad.clone()
        grid.cp.all_reduce(grad)
        check_close(f"grad of {name}", grad, rp.grad, RTOL_BF16)


def test_short_conv_fp32_weight_bf16_input():
    """The case that failed with "weight has dtype fp32, expected bf16"."""
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    conv = seqpar.ShortConvCp(grid, layout, C, W)
    x = torch.randn(B, S, C)
    out = conv(seqpar.shard_sequence(x, layout, grid.cp_rank).bfloat16())
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32
    want = short_conv_reference(x.double(), conv.weight.detach().double())
    check_close("conv out", seqpar.gather_sequence(grid, layout, out.float()), want, RTOL_BF16)


def test_mha_bf16_q_with_fp32_kv_and_sinks():
    grid = seqpar.CpGrid(1, 1, WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    q, k, v = torch.randn(B, S, 4, 16), torch.randn(B, S, 2, 16), torch.randn(B, S, 2, 16)
    attn = seqpar.MhaCp(grid, layout)
    local = [seqpar.shard_sequence(t, layout, grid.cp_rank) for t in (q, k, v)]
    out = attn(local[0].bfloat16(), local[1], local[2])
    assert out.dtype == torch.bfloat16
    want = mha_reference(q.double(), k.double(), v.double())
    check_close("mha out", seqpar.gather_sequence(grid, layout, out.float()), want, RTOL_BF16)
