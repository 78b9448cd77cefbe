"""seqpar inside a PyTorch training job: a DeviceMesh (dp=2, cp=2) at 4 processes under torchrun (gloo), a small
language model whose attention, short conv and GDN layers run under seqpar CP while the rest (embedding, norms,
projections, MLP, head) is replicated, wrapped in FSDP2 (fully_shard over dp) and, in a second run, in DDP over dp.
Five AdamW steps must give the losses and the parameters of the same model trained on one process on the whole
batch with whole-sequence references (python/tests/references.py) for its attention, conv and GDN, within 1e-5
relative (fp64: the differences are rounding, about 1e-13).

The training step of the sharded model: shard_labels (shift, then shard), sharded_cross_entropy (divided by the
sequence's token count over the CP ranks), backward (FSDP2 / DDP average over dp), all_reduce_cp_gradients (sum
over cp), step.

    torchrun --nproc-per-node 4 python/torch_tests/torchrun_compose.py   (PYTHONPATH: the build's python/)
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from references import gdn_reference, mha_reference, short_conv_reference  # noqa: E402

import seqpar  # noqa: E402

VOCAB, D, HEADS, HK, HV, DK, DV, WIDTH = 32, 16, 2, 2, 2, 8, 8, 4
T, BATCH, STEPS, LR, RTOL = 16, 2, 5, 1e-2, 1e-5


class RefConv(nn.Module):
    """The short conv on the whole sequence, with ShortConvCp's parameter name (weight [channels, width])."""

    def __init__(self, channels):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, WIDTH).uniform_(-0.5, 0.5))

    def forward(self, x):
        return short_conv_reference(x, self.weight)


class Attention(nn.Module):
    def __init__(self, cp):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.core = seqpar.MhaCp(cp[0], cp[1], causal=True) if cp else None

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.contiguous() for t in self.qkv(x).view(b, n, 3, HEADS, D // HEADS).unbind(2))
        out = self.core(q, k, v) if self.core is not None else mha_reference(q, k, v, causal=True)
        return self.o(out.reshape(b, n, D))


class GatedDeltaNet(nn.Module):
    def __init__(self, cp):
        super().__init__()
        channels = 2 * HK * DK + HV * DV
        self.in_proj, self.gates, self.out = nn.Linear(D, channels), nn.Linear(D, 2 * HV), nn.Linear(HV * DV, D)
        if cp:
            self.conv = seqpar.ShortConvCp(cp[0], cp[1], channels=channels, width=WIDTH)
            self.core = seqpar.GdnCp(cp[0], cp[1], mode="scan", chunk_size=4)
        else:
            self.conv, self.core = RefConv(channels), None

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.conv(self.in_proj(x)).split([HK * DK, HK * DK, HV * DV], -1)
        q, k, v = q.reshape(b, n, HK, DK), k.reshape(b, n, HK, DK), v.reshape(b, n, HV, DV)
        a, c = self.gates(x).chunk(2, -1)
        g, beta = F.logsigmoid(a + 2), torch.sigmoid(c)
        args = [t.contiguous() for t in (q, k, v, g, beta)]
        out = self.core(*args)[0] if self.core is not None else gdn_reference(*args)[0]
        return self.out(out.reshape(b, n, HV * DV))


class Block(nn.Module):
    def __init__(self, cp):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.gdn = Attention(cp), GatedDeltaNet(cp)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.gdn(self.norm2(x))
        return x + self.mlp(self.norm3(x))


class Model(nn.Module):
    """cp: (grid, layout) for seqpar's CP layers, or None for the whole-sequence references."""

    def __init__(self, cp=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(cp), Block(cp)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def reference_run(batches):
    """The single-process model on the whole batch: mean next-token cross-entropy over all its tokens."""
    torch.manual_seed(0)
    model = Model().to(torch.float64)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for tokens in batches:
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return initial, losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def relative(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


def sharded_run(wrapper, mesh, grid, layout, batches, initial, ref_losses, ref_params):
    model = Model((grid, layout)).to(torch.float64)
    model.load_state_dict(initial)  # the reference model's initial weights
    dp_group = mesh.get_group("dp")
    if wrapper == "fsdp2":
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        trained = model
    else:
        trained = DistributedDataParallel(model, process_group=dp_group)
    opt = torch.optim.AdamW(trained.parameters(), lr=LR)
    dp_rank = mesh.get_local_rank("dp")
    worst_loss = 0.0
    for step, tokens in enumerate(batches):
        row = tokens[dp_rank:dp_rank + 1]  # this replica's sequence, cut over its CP ranks
        local_tokens = seqpar.shard_sequence(row, layout, grid.cp_rank)
        local_labels = seqpar.shard_labels(row, layout, grid.cp_rank)
        loss = seqpar.sharded_cross_entropy(trained(local_tokens), local_labels, grid)
        opt.zero_grad()
        loss.backward()  # FSDP2 / DDP: gradients averaged over dp
        seqpar.all_reduce_cp_gradients(trained.parameters(), grid)  # summed over cp
        opt.step()
        logged = loss.detach().clone().reshape(1)
        grid.cp.all_reduce(logged)  # the sequence's mean
        dist.all_reduce(logged, group=dp_group)
        logged /= mesh.size(0)  # the batch's mean
        err = abs(logged.item() - ref_losses[step]) / abs(ref_losses[step])
        worst_loss = max(worst_loss, err)
        assert err <= RTOL, f"rank {dist.get_rank()} {wrapper}: step {step} loss {logged.item()} vs {ref_losses[step]}"
    worst_param = 0.0
    named = trained.module.named_parameters() if wrapper == "ddp" else trained.named_parameters()
    for name, p in named:
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        err = relative(full.detach(), ref_params[name])
        worst_param = max(worst_param, err)
        assert err <= RTOL, f"rank {dist.get_rank()} {wrapper}: parameter {name} differs by {err:.3g} (relative)"
    if dist.get_rank() == 0:
        print(f"ok {wrapper}: {STEPS} AdamW steps on dp=2 x cp=2 ({grid}): losses within {worst_loss:.2g}, "
              f"parameters within {worst_param:.2g} (relative) of one process", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    assert dist.get_world_size() == 4, "run with --nproc-per-node 4"
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    grid = seqpar.torch_grid(device_mesh=mesh, cp_dim="cp", dp_dim="dp")
    layout = seqpar.SequenceLayout.for_grid(grid, T)
    torch.manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, T)) for _ in range(STEPS)]
    initial, ref_losses, ref_params = reference_run(batches)
    # The step changes the model: a test that could pass with an untrained model would show nothing.
    assert max(relative(ref_params[k], initial[k]) for k in ref_params) > 1e-3
    for wrapper in ("fsdp2", "ddp"):
        sharded_run(wrapper, mesh, grid, layout, batches, initial, ref_losses, ref_params)
    assert "mpi4py" not in sys.modules and not seqpar._seqpar.mpi_initialized()
    dist.barrier()
    seqpar.distributed.clear_grid_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
