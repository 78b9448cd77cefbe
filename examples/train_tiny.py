#!/usr/bin/env python3
"""A tiny hybrid language model trained with seqpar's PyTorch layers under sequence parallelism.

The model follows Qwen3-Next's 3:1 pattern: an embedding, 4 blocks (3 gated-delta-rule blocks, then 1 attention
block), each a pre-RMSNorm token mixer and a pre-RMSNorm MLP with residuals, a final RMSNorm and the LM head. The
GDN blocks run a short causal conv over their q, k, v projections and seqpar.GdnCp; the attention
block uses RoPE at the tokens' global positions and seqpar.MhaCp (GQA, causal). Every rank holds the whole
batch of synthetic tokens, keeps its piece of the sequence (seqpar.shard_sequence), computes the loss of its tokens
and sums the parameter gradients over the CP group before each AdamW step.

    mpirun -np 4 python3 examples/train_tiny.py                 # USP 2 x 2 (--ulysses-size, --ring-size)
    mpirun -np 4 python3 examples/train_tiny.py --check         # also trains the single-process model on rank 0
                                                                # and compares the per-step losses and the final
                                                                # parameters (relative difference, norm of each
                                                                # tensor, 1e-5)
    torchrun --nproc-per-node 4 examples/train_tiny.py --check  # the same over torch.distributed (gloo), no MPI

Needs PYTHONPATH=<build>/python (or pip install .); under mpirun, mpi4py for --check (the single-process model runs
on MPI_COMM_SELF; under torchrun on a group of rank 0 alone).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

import seqpar

VOCAB, D_MODEL, D_MLP = 64, 32, 64
MHA_HEADS, MHA_KV_HEADS, HEAD_DIM = 4, 2, 8
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_DIM, CONV_WIDTH = 2, 4, 8, 4


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, positions, base=10000.0):
    """Rotary embedding of x [B, S_local, H, D] at the tokens' global positions (rotate-half convention)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype)[None, :, None, :], angles.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class AttentionMixer(torch.nn.Module):
    def __init__(self, grid, layout):
        super().__init__()
        self.q = torch.nn.Linear(D_MODEL, MHA_HEADS * HEAD_DIM, bias=False)
        self.kv = torch.nn.Linear(D_MODEL, 2 * MHA_KV_HEADS * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(MHA_HEADS * HEAD_DIM, D_MODEL, bias=False)
        self.attn = seqpar.MhaCp(grid, layout, causal=True)
        self.positions = layout.positions(grid.cp_rank)

    def forward(self, x):
        B, S = x.shape[:2]
        q = rope(self.q(x).view(B, S, MHA_HEADS, HEAD_DIM), self.positions)
        k, v = self.kv(x).view(B, S, 2, MHA_KV_HEADS, HEAD_DIM).unbind(2)
        out = self.attn(q.contiguous(), rope(k, self.positions).contiguous(), v.contiguous())
        return self.o(out.reshape(B, S, -1))


class GdnMixer(torch.nn.Module):
    def __init__(self, grid, layout):
        super().__init__()
        self.qk_dim, self.v_dim = GDN_KEY_HEADS * GDN_DIM, GDN_VALUE_HEADS * GDN_DIM
        self.qkv = torch.nn.Linear(D_MODEL, 2 * self.qk_dim + self.v_dim, bias=False)
        self.conv = seqpar.ShortConvCp(grid, layout, 2 * self.qk_dim + self.v_dim, CONV_WIDTH)
        self.gates = torch.nn.Linear(D_MODEL, 2 * GDN_VALUE_HEADS)  # log decay and beta per value head
        self.o = torch.nn.Linear(self.v_dim, D_MODEL, bias=False)
        self.gdn = seqpar.GdnCp(grid, layout, mode="scan")

    def forward(self, x):
        B, S = x.shape[:2]
        q, k, v = self.conv(self.qkv(x)).split([self.qk_dim, self.qk_dim, self.v_dim], -1)
        a, b = self.gates(x).chunk(2, -1)
        heads = lambda t, h: t.reshape(B, S, h, GDN_DIM).contiguous()  # noqa: E731 (split gives strided views)
        out, _ = self.gdn(heads(q, GDN_KEY_HEADS), heads(k, GDN_KEY_HEADS), heads(v, GDN_VALUE_HEADS),
                          F.logsigmoid(a + 3).contiguous(), torch.sigmoid(b).contiguous())
        return self.o(out.reshape(B, S, -1))


class Block(torch.nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.norm1, self.mixer = RMSNorm(D_MODEL), mixer
        self.norm2 = RMSNorm(D_MODEL)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D_MODEL, D_MLP), torch.nn.SiLU(), torch.nn.Linear(D_MLP, D_MODEL))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyHybridLM(torch.nn.Module):
    """Embedding, GDN x 3 + attention x 1, RMSNorm, LM head; the same parameters for any grid (built from the seed)."""

    def __init__(self, grid, layout, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        self.blocks = torch.nn.ModuleList([Block(GdnMixer(grid, layout)) for _ in range(3)] +
                                          [Block(AttentionMixer(grid, layout))])
        self.norm = RMSNorm(D_MODEL)
        self.head = torch.nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def synthetic_batch(batch, seq_len, seed=1):
    """Tokens with structure to learn: each token is (previous + the one three back) mod VOCAB, from random starts."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(batch, seq_len + 1, dtype=torch.int64)
    tokens[:, :3] = torch.randint(0, VOCAB, (batch, 3), generator=gen)
    for t in range(3, seq_len + 1):
        tokens[:, t] = (tokens[:, t - 1] + tokens[:, t - 3]) % VOCAB
    noise = torch.rand(batch, seq_len + 1, generator=gen) < 0.1
    tokens[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def train(grid, args):
    """Trains the model on this rank's piece of the sequence; returns the per-step losses and the model."""
    layout = seqpar.SequenceLayout.for_grid(grid, args.seq_len, args.layout)
    model = TinyHybridLM(grid, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    inputs, targets = synthetic_batch(args.batch, args.seq_len)
    local_inputs = seqpar.shard_sequence(inputs, layout, grid.cp_rank)
    local_targets = seqpar.shard_sequence(targets, layout, grid.cp_rank)
    num_tokens = targets.numel()
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        logits = model(local_inputs)
        # This rank's share of the mean over every token of the sequence: the sum over the ranks is the loss.
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), local_targets.reshape(-1), reduction="sum") / num_tokens
        loss.backward()
        for p in model.parameters():  # the gradient of the whole sequence: a sum over the CP group
            grid.cp.all_reduce(p.grad)
        opt.step()
        total = loss.detach().reshape(1).clone()
        grid.cp.all_reduce(total)
        losses.append(total.item())
    return losses, model


def relative_error(a, b):
    """||a - b|| / ||b|| (Frobenius). Not element-wise: AdamW divides each gradient element by its own running
    magnitude, so an element whose gradient nearly cancels (a sum of terms much larger than itself) moves by about
    the learning rate in a direction its rounding decides; the tensor as a whole is what must match."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ulysses-size", type=int, default=2)
    parser.add_argument("--ring-size", type=int, default=0, help="default: world size / ulysses size")
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--check", action="store_true",
                        help="train the single-process model too and compare (fp32, 1e-5 relative)")
    parser.add_argument("--rtol", type=float, default=1e-5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # launched by torchrun: torch.distributed groups, no MPI
    if torchrun:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        size = dist.get_world_size()
    else:
        size = seqpar.world().size
    ulysses = args.ulysses_size if size % args.ulysses_size == 0 else 1
    ring = args.ring_size or size // ulysses
    if torchrun:
        mesh = init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
        grid = seqpar.torch_grid(device_mesh=mesh, ulysses_dim="ulysses", ring_dim="ring")
        solo = dist.new_group([0])  # every rank makes it; rank 0 trains the single-process model on it (--check)
    else:
        grid = seqpar.CpGrid(dp_size=1, ulysses_size=ulysses, ring_size=ring)
    world = grid.world
    losses, model = train(grid, args)
    if world.rank == 0:
        print(f"# train_tiny: seqpar {seqpar.__version__}, grid {grid}, {args.layout} layout, seq_len {args.seq_len},"
              f" batch {args.batch}, {args.steps} AdamW steps, fp32")
    if not args.check:
        if world.rank == 0:
            print(f"{'step':>4} {'loss':>12}")
            for step, loss in enumerate(losses):
                print(f"{step:4d} {loss:12.6f}")
        return 0

    # The single-process model: the same code on a grid of one rank (MPI_COMM_SELF), trained on rank 0 only; its
    # losses and parameters are broadcast so that every rank checks (and fails) alike.
    ref_losses = torch.zeros(args.steps, dtype=torch.float64)
    ref_params = [torch.zeros_like(p) for p in model.parameters()]
    if world.rank == 0:
        if torchrun:
            single = seqpar.torch_grid(process_group=solo)
        else:
            from mpi4py import MPI

            single = seqpar.CpGrid(1, 1, 1, comm=MPI.COMM_SELF)
        losses_1, model_1 = train(single, args)
        ref_losses.copy_(torch.tensor(losses_1, dtype=torch.float64))
        ref_params = [p.detach().clone() for p in model_1.parameters()]
    world.broadcast(ref_losses)
    for p in ref_params:
        world.broadcast(p)

    if world.rank == 0:
        print(f"{'step':>4} {'loss (' + str(grid.cp.size) + ' ranks)':>16} {'loss (1 process)':>16} {'rel. diff':>10}")
    worst_loss = 0.0
    for step, (loss, ref) in enumerate(zip(losses, ref_losses.tolist())):
        diff = abs(loss - ref) / abs(ref)
        worst_loss = max(worst_loss, diff)
        if world.rank == 0:
            print(f"{step:4d} {loss:16.8f} {ref:16.8f} {diff:10.2e}")
    names = [name for name, _ in model.named_parameters()]
    param_errors = {name: relative_error(p.detach(), r) for name, p, r in zip(names, model.parameters(), ref_params)}
    worst_name = max(param_errors, key=param_errors.get)
    if world.rank == 0:
        print(f"# max relative difference: losses {worst_loss:.2e}, parameters {param_errors[worst_name]:.2e} "
              f"({worst_name}); tolerance {args.rtol:g}")
    if worst_loss > args.rtol or param_errors[worst_name] > args.rtol:
        print(f"rank {world.rank}: error: the {grid.cp.size}-rank training differs from the single-process one "
              f"(losses {worst_loss:.3g}, parameter {worst_name} {param_errors[worst_name]:.3g}; tolerance "
              f"{args.rtol:g})", file=sys.stderr)
        return 1
    if world.rank == 0:
        print("check passed")
    return 0


if __name__ == "__main__":
    rc = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # gloo may abort a process that exits with its groups alive
        seqpar.distributed.clear_grid_cache()
        torch.distributed.destroy_process_group()
    sys.exit(rc)
