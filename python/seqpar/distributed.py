"""seqpar over torch.distributed: a CpGrid from process groups or a DeviceMesh, for jobs launched with torchrun.

    torch.distributed.init_process_group("gloo")                           # torchrun --nproc-per-node 4 ...
    grid = seqpar.torch_grid(process_group=cp_group)                       # ring attention over cp_group
    grid = seqpar.torch_grid(ulysses_group=u, ring_group=r)                # USP: Ulysses x ring
    grid = seqpar.torch_grid(device_mesh=mesh, cp_dim="cp", dp_dim="dp")   # a DeviceMesh and its dimension names

The grid's communicators call torch.distributed on these groups (python/src/torch_comm.h): no MPI is initialised
and mpi4py is never imported. The layers take the same keywords instead of a grid (MhaCp(layout=...,
process_group=g)); a grid is built once per set of groups and shared.

The groups: `cp_group` (alias `process_group`) alone is ring attention over it (ulysses_size 1); `ulysses_group`
and `ring_group` make a Pu x Pr grid, and `cp_group` may come with them (its rank order must then be
cp_rank = ring_rank * ulysses_size + ulysses_rank), otherwise seqpar makes it; `dp_group` is optional (grid.dp:
gradients of data parallelism; FSDP and DDP bring their own). With a DeviceMesh, the dimension names select the
groups (cp_dim, ulysses_dim, ring_dim, dp_dim); a mesh of one dimension is the cp group.

Collective over the default group: every rank of the job calls torch_grid with its groups (as
torch.distributed.new_group requires), also for a grid it has built before. The ranks gather each other's groups
(or the error their arguments gave) and check that they form grids (each grid's ranks pass the same cp group, dp
groups of one size, Ulysses and ring groups that agree and form a Pu x Pr grid in the cp group's order); otherwise
every rank raises the same seqpar.Error, naming the ranks and their groups. Ranks that passed different groups
therefore fail together instead of meeting in mismatched collectives. The exception: a grid of one rank (a
single-process reference on one rank, e.g. process_group=torch.distributed.new_group([0]) on rank 0) is built by
that rank alone, with no collective.
"""

import torch
import torch.distributed as dist

from . import _seqpar

_GROUP_KEYS = ("process_group", "cp_group", "ulysses_group", "ring_group", "dp_group", "device_mesh", "cp_dim",
               "ulysses_dim", "ring_dim", "dp_dim")

# Grids already built, by the identity of their groups: layers given the same groups share one grid.
_grids = {}


def _error(message):
    return _seqpar.Error(f"seqpar.torch_grid: {message}")


def _ranks(group):
    return list(dist.get_process_group_ranks(group))


def _spec(group, name):
    """(process_group or None, world ranks in group rank order, this rank's group rank) for the C++ grid."""
    me = dist.get_rank()
    if group is None:
        return (None, [me], 0)
    ranks = _ranks(group)
    if me not in ranks:
        raise _error(f"world rank {me} is not a member of the {name} group it passed (world ranks {ranks})")
    return (group, ranks, ranks.index(me))


def _mesh_groups(mesh, cp_dim, ulysses_dim, ring_dim, dp_dim):
    names = tuple(mesh.mesh_dim_names or ())
    if cp_dim is None and ulysses_dim is None and ring_dim is None:
        if mesh.ndim != 1:
            raise _error(f"a DeviceMesh of {mesh.ndim} dimensions {names} needs cp_dim=, or ulysses_dim= and "
                         f"ring_dim=, naming the dimensions seqpar runs on")
        return mesh.get_group(), None, None, None

    def group(dim):
        if dim is None:
            return None
        if dim not in names:
            raise _error(f"the DeviceMesh has no dimension '{dim}' (its dimensions: {names})")
        return mesh.get_group(dim)

    return group(cp_dim), group(ulysses_dim), group(ring_dim), group(dp_dim)


def _grid_table(rows, pu, pr):
    """Checks that the Ulysses and ring groups in `rows` ({world rank: (ulysses ranks, ring ranks)}, every member of
    the grids involved) form Pu x Pr grids; returns {world rank: ordered cp ranks (cp_rank = r * Pu + u)}."""
    for m, (u, r) in sorted(rows.items()):
        if len(u) != pu or len(r) != pr:
            raise _error(f"world rank {m} has a ulysses group of {len(u)} and a ring group of {len(r)} ranks; every "
                         f"rank of the grid needs ulysses_size {pu} and ring_size {pr} (as the first rank)")
        for name, members, idx in (("ulysses", u, 0), ("ring", r, 1)):
            for x in members:
                if x not in rows:
                    raise _error(f"world rank {x}, in the {name} group {members} of world rank {m}, did not take part "
                                 f"in building this grid")
                if rows[x][idx] != members:
                    raise _error(f"world ranks {m} and {x} disagree on their {name} group: {members} on world rank "
                                 f"{m}, {rows[x][idx]} on world rank {x}")
        if set(u) & set(r) != {m}:
            raise _error(f"world rank {m}'s ulysses group {u} and ring group {r} share world ranks "
                         f"{sorted(set(u) & set(r) - {m})} besides {m}: they do not form a {pu} x {pr} grid")
    cp = {}
    for m, (_, r) in rows.items():
        order = [rows[r[i]][0][j] for i in range(pr) for j in range(pu)]  # ring rank i, ulysses rank j
        for i in range(pr):
            for j in range(pu):
                x = order[i * pu + j]
                column = [order[k * pu + j] for k in range(pr)]
                if rows[x][1] != column:
                    raise _error(f"the ulysses and ring groups do not form a {pu} x {pr} grid: world rank {x} "
                                 f"(ulysses rank {j} of the ulysses group of world rank {r[i]}) has the ring group "
                                 f"{rows[x][1]}, but the grid needs {column}")
        cp[m] = order
    return cp


def _components(table):
    """The grids of `table` (one row per world rank: rank, ulysses ranks, ring ranks, cp ranks or None, dp size):
    the sets of world ranks joined by their ulysses, ring and cp groups, each sorted, in the order of their first
    rank."""
    links = {row[0]: set(row[1]) | set(row[2]) | set(row[3] or ()) for row in table}
    seen, grids = set(), []
    for start in sorted(links):
        if start in seen:
            continue
        grid, todo = set(), [start]
        while todo:
            x = todo.pop()
            if x in grid:
                continue
            grid.add(x)
            todo.extend(y for y in links.get(x, ()) if y not in grid)
        seen |= grid
        grids.append(sorted(grid))
    return grids


def _check_grids(table):
    """Checks every grid of the job from the rows of all its world ranks (the same table, so the same first error,
    on every rank); returns {world rank: its cp ranks in cp_rank order}."""
    rows = {row[0]: row for row in table}
    cp = {}
    for grid in _components(table):
        for x in grid:
            if x not in rows:
                raise _error(f"world rank {x}, in a group of world rank {grid[0]}, is not a rank of the default group")
        first = rows[grid[0]]
        for x in grid[1:]:
            if rows[x][3] != first[3]:
                passed = [f"{m}: {rows[m][3] if rows[m][3] is not None else 'none (seqpar makes it)'}"
                          for m in (grid[0], x)]
                raise _error(f"world ranks {grid[0]} and {x} pass different cp groups ({'; '.join(passed)}); every "
                             f"rank of a grid passes the same cp group (world rank: cp group ranks)")
        for x in grid[1:]:
            if rows[x][4] != first[4]:
                raise _error(f"world ranks {grid[0]} and {x} pass dp groups of different sizes ({first[4]} and "
                             f"{rows[x][4]}); every rank of a grid passes a dp group of the same size")
        orders = _grid_table({x: (rows[x][1], rows[x][2]) for x in grid}, len(first[1]), len(first[2]))
        if first[3] is not None and first[3] != orders[grid[0]]:
            raise _error(f"the cp group's rank order {first[3]} is not the grid's {orders[grid[0]]} (cp_rank = "
                         f"ring_rank * ulysses_size + ulysses_rank); pass ulysses_group and ring_group without "
                         f"cp_group, or a cp group made in that order")
        cp.update(orders)
    return cp


def _make_cp_groups(table, cp_orders):
    """This rank's cp group when seqpar makes it. Every rank of the job makes every grid's cp group that seqpar
    makes, in the same order (torch.distributed.new_group's rule)."""
    made = {}
    for row in table:
        order = tuple(cp_orders[row[0]])
        if row[3] is None and order not in made:
            made[order] = _new_group(list(order))
    return made[tuple(cp_orders[dist.get_rank()])]


def _new_group(ranks):
    """A gloo/nccl group whose rank order is `ranks` (new_group would sort them)."""
    from torch.distributed import distributed_c10d as c10d
    try:
        return c10d._new_group_with_tag(ranks, sort_ranks=False)
    except TypeError:  # an older torch without sort_ranks: usable only when the order is sorted already
        if list(ranks) != sorted(ranks):
            raise _error(f"this torch cannot make a cp group in the order {ranks}; pass cp_group (ranks in the order "
                         f"cp_rank = ring_rank * ulysses_size + ulysses_rank)") from None
        return dist.new_group(ranks)


def _resolve_groups(process_group, cp_group, ulysses_group, ring_group, dp_group, device_mesh, cp_dim,
                    ulysses_dim, ring_dim, dp_dim):
    """(cp, ulysses, ring, dp) groups from torch_grid's arguments (module docstring), before any check across
    ranks."""
    if process_group is not None and cp_group is not None:
        raise _error("pass the cp group once: process_group= and cp_group= are the same argument")
    cp_group = cp_group if cp_group is not None else process_group
    if device_mesh is not None:
        if any(g is not None for g in (cp_group, ulysses_group, ring_group, dp_group)):
            raise _error("pass either device_mesh= with dimension names, or process groups, not both")
        cp_group, ulysses_group, ring_group, dp_group = _mesh_groups(device_mesh, cp_dim, ulysses_dim, ring_dim,
                                                                     dp_dim)
    elif any(d is not None for d in (cp_dim, ulysses_dim, ring_dim, dp_dim)):
        raise _error("cp_dim, ulysses_dim, ring_dim and dp_dim name dimensions of device_mesh=, which is missing")
    if cp_group is None and ulysses_group is None and ring_group is None:
        raise _error("no group: pass process_group= (or cp_group=), ulysses_group= and ring_group=, or device_mesh=")
    if (ulysses_group is None) != (ring_group is None) and cp_group is not None:
        raise _error("with cp_group=, pass both ulysses_group= and ring_group= or neither")
    if ulysses_group is None and ring_group is None:
        ring_group = cp_group  # ring attention over the cp group
    elif cp_group is None and (ulysses_group is None or ring_group is None):
        cp_group = ring_group if ring_group is not None else ulysses_group

    return cp_group, ulysses_group, ring_group, dp_group


def torch_grid(process_group=None, *, cp_group=None, ulysses_group=None, ring_group=None, dp_group=None,
               device_mesh=None, cp_dim=None, ulysses_dim=None, ring_dim=None, dp_dim=None):
    """The seqpar.CpGrid over torch.distributed groups (module docstring); cached per set of groups."""
    if not dist.is_available() or not dist.is_initialized():
        raise _error("torch.distributed is not initialised: call torch.distributed.init_process_group (torchrun "
                     "sets its environment) first")
    # This rank's groups, or the error they gave: gathered over the default group before either is acted on, so
    # that a rank whose arguments fail does not leave the others waiting, and every rank raises the same error.
    me, error, groups = dist.get_rank(), None, None
    try:
        groups = _resolve_groups(process_group, cp_group, ulysses_group, ring_group, dp_group, device_mesh, cp_dim,
                                 ulysses_dim, ring_dim, dp_dim)
    except Exception as e:  # noqa: BLE001  (sent to every rank, raised there as seqpar.Error)
        error = e
    cached = None
    if groups is not None:
        cp_group, ulysses_group, ring_group, dp_group = groups
        cached = _grids.get(tuple(id(g) for g in groups))
        if cached is not None and not all(a is b for a, b in zip(cached[0], groups)):
            cached = None
        try:
            u_ranks = _spec(ulysses_group, "ulysses")[1]
            r_ranks = _spec(ring_group, "ring")[1]
            cp_ranks = _spec(cp_group, "cp")[1] if cp_group is not None else None
            dp_size = len(_spec(dp_group, "dp")[1])
        except Exception as e:  # noqa: BLE001
            error = e
    if error is not None:
        text = str(error).removeprefix("seqpar.torch_grid: ")
        mine = (me, None, None, None, None, text if isinstance(error, _seqpar.Error) else
                f"{type(error).__name__}: {text}", False)
    else:
        mine = (me, u_ranks, r_ranks, cp_ranks, dp_size, None, cached is not None)
    if error is None and len(u_ranks) == 1 and len(r_ranks) == 1 and (cp_ranks is None or len(cp_ranks) == 1):
        # a one-rank grid (a single-process reference on one rank): nothing to agree on, built by this rank alone
        table = [mine]
        if cp_group is None:
            cp_group = ring_group
    else:
        table = [None] * dist.get_world_size()
        dist.all_gather_object(table, mine)  # over the default group: every rank of the job calls torch_grid
    table.sort(key=lambda row: row[0])
    for row in table:
        if row[5] is not None:
            raise _error(f"world rank {row[0]}: {row[5]}") from None
    cp_orders = _check_grids(table)
    # The grid already built for these groups, when every rank has it (else all build it again: making the cp
    # group is collective).
    if all(row[6] for row in table):
        return cached[1]
    cp_group = _make_cp_groups(table, cp_orders) if cp_group is None else cp_group
    placement = "ring_inner" if len(u_ranks) > 1 and u_ranks != list(range(u_ranks[0], u_ranks[0] + len(u_ranks))) \
        else "ulysses_inner"
    world = (dist.group.WORLD, list(range(dist.get_world_size())), me)
    grid = _seqpar.CpGrid._from_torch(world, _spec(ulysses_group, "ulysses"), _spec(ring_group, "ring"),
                                      _spec(cp_group, "cp"), _spec(dp_group, "dp"), placement)
    _grids[tuple(id(g) for g in groups)] = (groups, grid)  # the groups as passed (the objects keep their ids taken)
    return grid


def clear_grid_cache():
    """Forget the grids torch_grid built (before destroy_process_group, or to rebuild them)."""
    _grids.clear()


def resolve_grid(grid, kwargs):
    """The grid of a layer: `grid` itself (a seqpar.CpGrid), or one built by torch_grid from a ProcessGroup or a
    DeviceMesh passed as `grid` and the group keywords popped from `kwargs`."""
    groups = {k: kwargs.pop(k) for k in _GROUP_KEYS if k in kwargs}
    if isinstance(grid, _seqpar.CpGrid):
        if groups:
            raise _seqpar.Error(f"pass a seqpar.CpGrid or torch.distributed groups, not both (got {sorted(groups)})")
        return grid
    if grid is not None:
        if isinstance(grid, dist.ProcessGroup):
            groups.setdefault("process_group", grid)
        elif type(grid).__name__ == "DeviceMesh":
            groups.setdefault("device_mesh", grid)
        else:
            raise _seqpar.Error(f"grid: expected a seqpar.CpGrid, a torch.distributed ProcessGroup or a DeviceMesh, "
                                f"got {type(grid).__name__}")
    if not groups:
        raise _seqpar.Error("no grid: pass a seqpar.CpGrid, or process_group= / ulysses_group= and ring_group= / "
                            "device_mesh= with its dimension names")
    return torch_grid(**groups)


def resolve_layout(grid, layout):
    """A layer's layout: a seqpar.SequenceLayout, or an int seq_len for the grid's default (zigzag) layout."""
    if isinstance(layout, int) and not isinstance(layout, bool):
        return _seqpar.SequenceLayout.for_grid(grid, layout)
    if not isinstance(layout, _seqpar.SequenceLayout):
        raise _seqpar.Error(f"layout: expected a seqpar.SequenceLayout or an int seq_len, got {type(layout).__name__}")
    return layout


def all_reduce_cp_gradients(parameters, grid):
    """Sums the gradients of `parameters` over the grid's cp group, in place (one collective per gradient).

    With sequence parallelism, each CP rank's backward gives a parameter outside seqpar's layers (embeddings, MLPs,
    norms) the gradient of its own tokens only; the model's gradient is their sum. Call it between backward() and
    the optimizer step (FSDP2: the gradients' local shards, summed over cp ranks that hold the same shard). Not
    needed when DDP or FSDP already reduce over a group that includes the cp ranks (then scale the loss as that
    reduction averages)."""
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        local = g.to_local() if hasattr(g, "to_local") else g
        if not local.is_contiguous():
            raise _seqpar.Error(f"all_reduce_cp_gradients: a gradient of shape {tuple(local.shape)} is not contiguous")
        grid.cp.all_reduce(local)
