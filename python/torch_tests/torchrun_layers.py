"""seqpar's layers under torchrun over torch.distributed (gloo), without MPI: every way of passing the groups
(process_group=, ulysses_group= + ring_group= with and without cp_group=, a DeviceMesh with either dimension
inner) at every (ulysses_size, ring_size) of the world; MHA / GQA (p2p and all-gather rings), GDN, the short conv
and DSA (ring and all-gather selection), forward and backward against the whole-sequence references of
python/tests/references.py (fp64), scatter / gather of a packed row; so every kind of message seqpar sends
(point-to-point, all-to-all, all_to_all_v, all-gather, reduce-scatter, all-reduce, broadcast). Then the agreement
check (of the layers and of scatter / gather_sequence), the errors for groups that do not form a grid, and at the
end: mpi4py never imported, MPI never initialised.

    torchrun --nproc-per-node 4 python/torch_tests/torchrun_layers.py   (PYTHONPATH: the build's python/)
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import references  # noqa: E402
from references import (dsa_reference, gdn_reference, mha_reference, random_full,  # noqa: E402
                        run_against_reference, short_conv_reference)

import seqpar  # noqa: E402

S = 48
RTOL = 1e-10  # fp64 end to end; chunked and ring summation orders differ from the references by rounding only


def check_close(name, got, want, rtol):
    """As references.check_close, with the torch rank in the message (references' asks MPI for it)."""
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    assert got.shape == want.shape, f"rank {dist.get_rank()}: {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs()
    bound = rtol * max(1.0, want.abs().max().item())
    worst = int(err.argmax())
    assert err.max().item() <= bound, (f"rank {dist.get_rank()}: {name}: flat index {worst}: {got.flatten()[worst]} "
                                       f"vs reference {want.flatten()[worst]} (max error {err.max().item():.3g})")


references.check_close = check_close  # run_against_reference reports through it


def expect_error(fn, *fragments):
    try:
        fn()
    except seqpar.Error as e:
        for f in fragments:
            assert f in str(e), f"rank {dist.get_rank()}: expected '{f}' in the error: {e}"
        return str(e)
    raise AssertionError(f"rank {dist.get_rank()}: no seqpar.Error (expected one with {fragments})")


def expect_same_error(fn, *fragments):
    """expect_error on every rank, with the same message on every rank."""
    message = expect_error(fn, *fragments)
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, f"rank {dist.get_rank()}: the ranks raised different errors: {messages}"


def run_layers(label, **groups):
    """MHA (GQA, causal), GDN (scan, initial state), the short conv and DSA on the grid the groups make."""
    grid = seqpar.torch_grid(**groups)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    torch.manual_seed(1)

    attn = seqpar.MhaCp(layout=layout, causal=True, **groups)
    assert attn.grid is grid, "layers given the same groups share the grid"
    q, k, v = random_full((1, S, 4, 8)), random_full((1, S, 2, 8)), random_full((1, S, 2, 8))
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v, causal=True)], []), RTOL)

    # bf16 and fp32 messages (gloo's own bf16 reduction in Ulysses' reduce-scatter); tolerances of
    # python/tests/test_mha.py
    for dtype, rtol in ((torch.bfloat16, 4e-2), (torch.float32, 1e-4)):
        qd, kd, vd = (random_full((1, S, h, 8), dtype) for h in (4, 2, 2))
        run_against_reference(grid, layout, [qd, kd, vd], [], lambda q, k, v: ([attn(q, k, v)], []),
                              lambda q, k, v: ([mha_reference(q, k, v, causal=True)], []), rtol)

    # the all-gather ring (all_gather forward, reduce_scatter backward)
    attn_ag = seqpar.MhaCp(grid, layout, impl="allgather", causal=True)
    q, k, v = random_full((1, S, 4, 8)), random_full((1, S, 2, 8)), random_full((1, S, 2, 8))
    run_against_reference(grid, layout, [q, k, v], [], lambda q, k, v: ([attn_ag(q, k, v)], []),
                          lambda q, k, v: ([mha_reference(q, k, v, causal=True)], []), RTOL)

    gdn = seqpar.GdnCp(grid, layout, mode="scan", chunk_size=4)
    g = F.logsigmoid(torch.randn(1, S, 4, dtype=torch.float64) + 2).requires_grad_()
    beta = torch.sigmoid(torch.randn(1, S, 4, dtype=torch.float64)).requires_grad_()
    sharded = [random_full((1, S, 2, 8)), random_full((1, S, 2, 8)), random_full((1, S, 4, 8)), g, beta]
    run_against_reference(grid, layout, sharded, [random_full((1, 4, 8, 8), scale=0.5)],
                          lambda *a: tuple([x] for x in gdn(*a)),
                          lambda *a: tuple([x] for x in gdn_reference(*a)), RTOL)

    conv = seqpar.ShortConvCp(layout=layout, channels=6, width=4, dtype=torch.float64, **groups)
    weight = conv.weight

    def conv_layer(x, w):
        return [conv(x)], []

    run_against_reference(grid, layout, [random_full((1, S, 6))], [weight], conv_layer,
                          lambda x, w: ([short_conv_reference(x, w)], []), RTOL)

    for select in ("ring", "allgather"):
        dsa = seqpar.DsaCp(grid, layout, select=select, topk=8, dim_v=8)
        inputs = [random_full((1, S, 4, 16)), random_full((1, S, 16)), random_full((1, S, 2, 8)),
                  random_full((1, S, 8)), random_full((1, S, 2))]
        run_against_reference(grid, layout, inputs, [], lambda *a: tuple([x] for x in dsa(*a)),
                              lambda *a: tuple([x] for x in dsa_reference(*a, topk=8, dim_v=8)), RTOL)

    # scatter / gather of a whole sequence (all_to_all_v over cp), a packed row with padding
    packed = seqpar.SequenceLayout.packed_for_grid(grid, [0, 5, 20, 37])
    full = torch.randn(1, 37, 3, dtype=torch.float64)
    local = seqpar.scatter_sequence(grid, packed, full, root=grid.cp.size - 1)
    check_close("scatter_sequence", local, seqpar.shard_sequence(full, packed, grid.cp_rank), 0)
    check_close("gather_sequence", seqpar.gather_sequence(grid, packed, local), full, 0)
    if dist.get_rank() == 0:
        print(f"ok {label}: {grid} (mha p2p fp64 / fp32 / bf16 and allgather, gdn, short conv, dsa ring and "
              f"allgather against the references; scatter / gather)", flush=True)
    return grid


def new_groups(partition):
    """This rank's group of `partition` (a list of rank lists); every rank makes every group, as torch requires."""
    mine = None
    for ranks in partition:
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    return mine


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)

    grid = run_layers("process_group=WORLD", process_group=dist.group.WORLD)
    t = torch.full((5,), float(rank), dtype=torch.bfloat16)
    grid.cp.broadcast(t, root=world - 1)
    grid.cp.barrier()
    assert t.tolist() == [world - 1.0] * 5, t
    assert grid.cp.name == "cp" and grid.ring.name == "ring" and grid.world.size == world
    # A ProcessGroup or a one-dimensional DeviceMesh in the grid's place, an int seq_len in the layout's.
    by_group = seqpar.MhaCp(dist.group.WORLD, S, causal=True)
    assert by_group.grid is grid and by_group.layout.seq_len == S and by_group.layout.kind == "zigzag"
    line = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    by_mesh = seqpar.GdnCp(line, S)
    assert by_mesh.grid.ring_size == world and by_mesh.grid.cp_rank == rank
    for u in [d for d in range(2, world + 1) if world % d == 0]:
        r = world // u
        # ulysses innermost (consecutive ranks), then ring innermost: seqpar makes the cp group in its own order.
        mesh = init_device_mesh("cpu", (r, u), mesh_dim_names=("ring", "ulysses"))
        run_layers(f"mesh ring x ulysses ({r} x {u})", device_mesh=mesh, ulysses_dim="ulysses", ring_dim="ring")
        mesh_t = init_device_mesh("cpu", (u, r), mesh_dim_names=("ulysses", "ring"))
        grid = run_layers(f"mesh ulysses x ring ({u} x {r})", device_mesh=mesh_t, ulysses_dim="ulysses",
                          ring_dim="ring")
        assert r == 1 or grid.placement == "ring_inner", grid.placement
        # explicit groups, with the world as the cp group (its order is the grid's when Ulysses is inner)
        ug = new_groups([list(range(i * u, (i + 1) * u)) for i in range(r)])
        rg = new_groups([list(range(j, world, u)) for j in range(u)])
        run_layers(f"ulysses_group + ring_group + cp_group ({u} x {r})", ulysses_group=ug, ring_group=rg,
                   cp_group=dist.group.WORLD)

    # Ulysses alone (the ring a group of this rank alone, without a ProcessGroup).
    if world > 1:
        run_layers("ulysses_group=WORLD", ulysses_group=dist.group.WORLD)
    # dp x ring x ulysses: seqpar makes one cp group per dp replica.
    if world == 4:
        for shape in ((2, 2, 1), (2, 1, 2)):
            mesh3 = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ring", "ulysses"))
            grid = run_layers(f"mesh dp x ring x ulysses {shape}", device_mesh=mesh3, ulysses_dim="ulysses",
                              ring_dim="ring", dp_dim="dp")
            assert (grid.dp_size, grid.dp_rank, grid.cp.size) == (2, rank // 2, 2), str(grid)

    # A DeviceMesh with dp: the grid's dp group, and cp from the mesh's cp dimension.
    if world % 2 == 0:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "cp"))
        grid = seqpar.torch_grid(device_mesh=mesh, cp_dim="cp", dp_dim="dp")
        assert (grid.dp_size, grid.ring_size, grid.dp_rank) == (2, world // 2, rank // (world // 2)), str(grid)
        t = torch.full((3,), float(rank))
        grid.dp.all_reduce(t)
        want = sum(x for x in range(world) if x % (world // 2) == rank % (world // 2))
        assert t.tolist() == [want] * 3, (t, want)

    # The agreement check: one rank with another head count fails on every rank, naming the field.
    grid = seqpar.torch_grid(process_group=dist.group.WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, S)
    attn = seqpar.MhaCp(grid, layout)
    heads = 4 if rank == 0 else 2
    q = torch.randn(1, layout.local_len, heads, 8)
    if world > 1:
        expect_error(lambda: attn(q, q, q), "disagree on q", "on cp rank 0")
        # The Python side's own fields over torch's groups too: rank 0 alone needs a gradient (it would wait in a
        # backward the others never run, until the timeout).
        qg = torch.randn(1, layout.local_len, 2, 8, requires_grad=rank == 0)
        expect_error(lambda: seqpar.MhaCp(grid, layout)(qg, qg, qg).sum().backward(), "MhaCp (Python)",
                     "disagree on backward (grad mode on and an input that requires grad): yes on cp rank 0; no on")
        # The sequence collectives check too: the same byte count with another dtype and trailing shape, another
        # byte count, and scatter's full of another dtype (they used to gather garbage or abort inside gloo).
        same_bytes = (torch.ones(1, layout.local_len, 4) if rank == 0 else
                      torch.ones(1, layout.local_len, 2, dtype=torch.float64))
        n = layout.local_len
        expect_error(lambda: seqpar.gather_sequence(grid, layout, same_bytes), "gather_sequence:",
                     f"disagree on local: fp32[1, {n}, 4] on cp rank 0; fp64[1, {n}, 2]")
        other_bytes = torch.ones(1, layout.local_len, 3 if rank == 0 else 4)
        expect_error(lambda: seqpar.gather_sequence(grid, layout, other_bytes),
                     f"disagree on local: fp32[1, {layout.local_len}, 3] on cp rank 0")
        full = torch.ones(1, S, 4) if rank == 0 else torch.zeros(1, S, 2, dtype=torch.float64)
        expect_error(lambda: seqpar.scatter_sequence(grid, layout, full), "scatter_sequence:",
                     f"disagree on local: fp32[1, {layout.local_len}, 4] on cp rank 0")

    # Groups that do not form a grid: the same error on every rank, naming the ranks.
    if world == 4:
        ug = new_groups([[0, 1], [2, 3]])
        expect_error(lambda: seqpar.torch_grid(ulysses_group=ug, ring_group=ug), "share world ranks")
        rg = new_groups([[0, 3], [1, 2]])
        expect_error(lambda: seqpar.torch_grid(ulysses_group=ug, ring_group=rg), "do not form a 2 x 2 grid",
                     "world rank")
        rg = new_groups([[0, 2], [1, 3]])
        cp_bad = dist.new_group([0, 1, 2, 3])
        # a cp group in the wrong order for a ring-inner grid: ulysses {0, 2}, {1, 3}; ring {0, 1}, {2, 3}
        expect_error(lambda: seqpar.torch_grid(ulysses_group=rg, ring_group=ug, cp_group=cp_bad), "rank order")
    expect_error(lambda: seqpar.torch_grid(device_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("x",)),
                                           cp_dim="y"), "no dimension 'y'")
    # Ranks that pass different groups, or where one rank's arguments fail: every rank raises the same error, naming
    # the groups or the rank (not a gloo error, nor a wait on the others).
    # (A grid of one rank is built by its rank alone, so "rest" needs two ranks or more to take part in the check.)
    rest = dist.new_group(list(range(1, world))) if world > 1 else None
    if world > 2:
        expect_same_error(lambda: seqpar.torch_grid(process_group=dist.group.WORLD if rank == 0 else rest),
                          "world ranks 0 and 1 pass different cp groups", f"1: {list(range(1, world))}")
    if world > 1:
        solo = dist.new_group([0])
        if rank == 0:  # a one-rank grid on one rank only (a single-process reference): no collective, no wait
            assert seqpar.torch_grid(process_group=solo).cp.size == 1
        line_x = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
        expect_same_error(lambda: seqpar.torch_grid(device_mesh=line_x, cp_dim="y" if rank == world - 1 else "x"),
                          f"world rank {world - 1}: the DeviceMesh has no dimension 'y'")
    if world == 4:
        pairs = new_groups([[0, 1], [2, 3]])
        expect_same_error(lambda: seqpar.torch_grid(process_group=pairs if rank < 2 else dist.group.WORLD),
                          "world ranks 0 and 2 pass different cp groups")
        ug, rg = new_groups([[0, 1], [2, 3]]), new_groups([[0, 2], [1, 3]])
        # rank 0: ring attention over its ring group; the others: USP, seqpar making the cp group
        expect_same_error(lambda: seqpar.torch_grid(ring_group=rg) if rank == 0 else
                          seqpar.torch_grid(ulysses_group=ug, ring_group=rg), "pass different cp groups",
                          "none (seqpar makes it)")
        expect_same_error(lambda: seqpar.torch_grid(ulysses_group=ug, ring_group=new_groups([[0, 3], [1, 2]])),
                          "do not form a 2 x 2 grid")
    expect_error(lambda: seqpar.MhaCp(object(), 16), "expected a seqpar.CpGrid")

    assert "mpi4py" not in sys.modules, "seqpar's torch path imported mpi4py"
    assert not seqpar._seqpar.mpi_initialized(), "seqpar's torch path initialised MPI"
    dist.barrier()
    if rank == 0:
        print(f"torchrun_layers: all checks passed at {world} processes (mpi4py not imported, MPI not initialised)",
              flush=True)
    seqpar.distributed.clear_grid_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
