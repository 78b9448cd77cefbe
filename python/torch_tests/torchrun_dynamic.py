"""Dynamic CP under torchrun (gloo, no MPI): seqpar.torch_grid_set builds the grids of every degree dividing the
world once; micro-batches of one step's documents run seqpar.MhaCp (causal, fp64) on their own grids, mixed degrees
and the static plans (all at 1, all at W); out, dq, dk, dv (each rank's tokens, all-reduced over the world) and the
gradient of a linear parameter w (out * w) equal each document run alone through PyTorch's attention in fp64 at
1e-10. Bad degree lists and plans raise seqpar.Error on every rank.

    torchrun --nproc-per-node 4 python/torch_tests/torchrun_dynamic.py   (PYTHONPATH: the build's python/)
"""

import datetime
import gc
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar

DOCS = [37, 5, 64, 1, 20, 90, 12, 3, 48, 7, 30, 16, 2, 55]
HQ, HKV, D = 4, 2, 16
TOL = 1e-10


def dealt_plan(degrees, world):
    """Documents longest first, dealt round-robin over the slots (degree, group), largest degree first."""
    slots = [(d, g, []) for d in sorted(degrees, reverse=True) for g in range(world // d)]
    for i, doc in enumerate(sorted(range(len(DOCS)), key=lambda j: -DOCS[j])):
        slots[i % len(slots)][2].append(doc)
    return [s for s in slots if s[2]]


def reference(q, k, v, dout, w):
    """Each document alone through PyTorch's attention (GQA by repeating KV heads), fp64."""
    q, k, v, w = (t.detach().clone().requires_grad_(True) for t in (q, k, v, w))
    outs, a = [], 0
    for n in DOCS:
        sl = slice(a, a + n)
        qd, kd, vd = (t[:, sl].transpose(1, 2) for t in (q, k, v))
        kd, vd = (t.repeat_interleave(HQ // HKV, dim=1) for t in (kd, vd))
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(1, 2))
        a += n
    out = torch.cat(outs, dim=1)
    (out * w * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, w.grad


def run_step(grids, plan, q, k, v, dout, w_init):
    """This rank's micro-batches in plan order; every token's out and gradients, all-reduced over the world."""
    plan = seqpar.check_dynamic_plan(grids, DOCS, plan)
    starts = [0]
    for n in DOCS:
        starts.append(starts[-1] + n)
    q, k, v, w = (t.detach().clone().requires_grad_(True) for t in (q, k, v, w_init))
    out_full = torch.zeros_like(q)
    for m in grids.local(plan):
        degree, _, docs = plan[m]
        grid = grids.grid(degree)
        rows = torch.tensor([t for d in docs for t in range(starts[d], starts[d + 1])])
        cu = [0]
        for d in docs:
            cu.append(cu[-1] + DOCS[d])
        layout = seqpar.SequenceLayout.packed_for_grid(grid, cu)
        ql, kl, vl, dl = (seqpar.shard_sequence(t[:, rows], layout, grid.cp_rank) for t in (q, k, v, dout))
        out = seqpar.MhaCp(grid, layout, causal=True)(ql, kl, vl)
        (out * w * dl).sum().backward()
        full = seqpar.gather_sequence(grid, layout, out.detach())
        if grid.cp_rank == 0:
            out_full[:, rows] = full
    got = [out_full, q.grad if q.grad is not None else torch.zeros_like(q),
           k.grad if k.grad is not None else torch.zeros_like(k), v.grad if v.grad is not None else torch.zeros_like(v),
           w.grad if w.grad is not None else torch.zeros_like(w)]
    for t in got:
        dist.all_reduce(t)
    return got


def expect_error(fn, fragment, same=False):
    """fn() raises seqpar.Error containing `fragment`; with same=True, every rank's message is the same text."""
    try:
        fn()
    except seqpar.Error as e:
        assert fragment in str(e), f"rank {dist.get_rank()}: expected '{fragment}' in: {e}"
        if same:
            msgs = [None] * dist.get_world_size()
            dist.all_gather_object(msgs, str(e))
            assert len(set(msgs)) == 1, f"rank {dist.get_rank()}: the ranks raised different messages: {msgs}"
        return
    raise AssertionError(f"rank {dist.get_rank()}: no seqpar.Error (expected '{fragment}')")


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world, me = dist.get_world_size(), dist.get_rank()
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    grids = seqpar.torch_grid_set(divisors)
    torch.manual_seed(3)
    T = sum(DOCS)
    q = torch.randn(1, T, HQ, D, dtype=torch.float64)
    k, v = (torch.randn(1, T, HKV, D, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, T, HQ, D, dtype=torch.float64)
    w = torch.randn(D, dtype=torch.float64)
    want = reference(q, k, v, dout, w)
    names = ["out", "dq", "dk", "dv", "dw"]
    for label, plan in [("mixed", dealt_plan(divisors, world)), ("static 1", dealt_plan([1], world)),
                        (f"static {world}", dealt_plan([world], world))]:
        got = run_step(grids, plan, q, k, v, dout, w)
        for name, g, r in zip(names, got, want):
            err = (g - r).abs().max().item()
            assert err <= TOL * max(1.0, r.abs().max().item()), f"rank {me}: {label}: {name} max error {err:.3g}"
        if me == 0:
            print(f"ok: {label} at {world} process(es): out, dq, dk, dv, dw within {TOL}")
    # Bad input, on every rank.
    if world > 1:
        expect_error(lambda: seqpar.torch_grid_set([1, world + 1]), "must divide the world size")
        expect_error(lambda: seqpar.torch_grid_set([1] if me == 0 else [1, world]), "ranks disagree on the degrees")
        bad = dealt_plan(divisors, world)
        if me == world - 1:
            bad[0][2][0], bad[-1][2][-1] = bad[-1][2][-1], bad[0][2][0]
        # The same message on every rank, naming each value once with the ranks that hold it (ranks 1.. used to print
        # rank 0's value twice and name rank 0 twice).
        moved = dealt_plan(divisors, world)
        moved[0][2][0], moved[-1][2][-1] = moved[-1][2][-1], moved[0][2][0]
        expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, bad),
                     f"seqpar.check_dynamic_plan: ranks disagree on the plan: micro-batch 0 is "
                     f"{dealt_plan(divisors, world)[:1]} on group ranks {list(range(world - 1))}, {moved[:1]} on group "
                     f"ranks [{world - 1}]; every rank must pass the same plan", same=True)
        lens = list(DOCS)
        if me == 0:
            lens[1] += 1
        expect_error(lambda: seqpar.check_dynamic_plan(grids, lens, dealt_plan(divisors, world)),
                     f"ranks disagree on the document lengths: {[DOCS[0], DOCS[1] + 1] + DOCS[2:]} on group ranks [0], "
                     f"{DOCS} on group ranks {list(range(1, world))}", same=True)
        # A malformed entry on one rank only: every rank stops at the agreement (the unpacking used to raise a bare
        # ValueError on that rank before the exchange, leaving the others in all_gather_object until the timeout).
        bad = dealt_plan(divisors, world)
        if me == world - 1:
            bad[0] = bad[0][:2]
        expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, bad), "ranks disagree on the plan: micro-batch 0")
    bad = dealt_plan(divisors, world)
    bad[-1][2].append(bad[0][2][0])
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, bad), "every document must be in exactly one")
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, [(2 * world, 0, list(range(len(DOCS))))]),
                 "has no grid")
    # Values that are not integers fail every rank alike (int() used to truncate 1.5, read "12" as 1 and 2 and True
    # as 1), and so does a negative length.
    expect_error(lambda: seqpar.torch_grid_set([1.5]), "degree 1.5 is not an integer")
    expect_error(lambda: seqpar.torch_grid_set("12"), "degree '12' is not an integer")
    expect_error(lambda: seqpar.torch_grid_set([True]), "degree True is not an integer")
    whole = [(world, 0, list(range(len(DOCS))))]
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, [(float(world), 0, whole[0][2])]),
                 "micro-batch 0's degree")
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, [(world, 0, [True] + whole[0][2][1:])]),
                 "micro-batch 0's document True is not an integer")
    expect_error(lambda: seqpar.check_dynamic_plan(grids, [-1] + list(DOCS[1:]), whole),
                 "document 0 has length -1; lengths must be >= 0")
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, [(world, 0)]),
                 "micro-batch 0 = (%d, 0) must be a (degree, group, [doc ids]) triple" % world)
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, None),
                 "seqpar.check_dynamic_plan: the plan must be a list of (degree, group, [doc ids]), got None")
    # A micro-batch of no tokens (no documents, or only documents of length 0), on a group smaller than the world:
    # refused on every rank by the plan check (its group used to fail in packed_for_grid, naming neither the plan
    # nor the micro-batch, while the other ranks went on into the next micro-batch's collective).
    small = world // 2 if world % 2 == 0 else 1
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS, [(small, 0, [])] + whole),
                 f"seqpar.check_dynamic_plan: micro-batch 0 (degree {small}, group 0) holds no tokens (documents [])",
                 same=True)
    zero = [(small, 0, [len(DOCS), len(DOCS) + 1]), (world, 0, whole[0][2])]
    expect_error(lambda: seqpar.check_dynamic_plan(grids, DOCS + [0, 0], zero),
                 f"micro-batch 0 (degree {small}, group 0) holds no tokens (documents [{len(DOCS)}, {len(DOCS) + 1}])",
                 same=True)
    # A document of length 0 beside others is run.
    assert seqpar.check_dynamic_plan(grids, DOCS + [0], [(world, 0, whole[0][2] + [len(DOCS)])])[0][2][-1] == len(DOCS)
    assert "mpi4py" not in sys.modules, "mpi4py was imported"
    assert not seqpar._seqpar.mpi_initialized(), "MPI was initialised"
    if me == 0:
        print("ok: bad degrees and plans raise on every rank")
    dist.barrier()
    # The grids hold the groups: dropped before the process group goes, as docs/python.md says (a gloo process that
    # exits with its groups alive sometimes aborts at exit).
    del grids
    seqpar.distributed.clear_grid_cache()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
