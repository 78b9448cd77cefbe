"""Dynamic context parallelism under torch.distributed (docs/python.md, "Dynamic CP"; the C++ counterparts are
runtime/cp_grid_set.h and parallel/dynamic_cp.h, the planner `sp_plan --dynamic-cp`).

    grids = seqpar.torch_grid_set([1, 2, 4])           # every rank, once: one grid per degree
    plan = seqpar.check_dynamic_plan(grids, doc_lens, micro_batches)   # [(degree, group, [doc ids]), ...]
    for m in grids.local(plan):                        # this rank's micro-batches, in plan order
        degree, group, docs = plan[m]
        grid = grids.grid(degree)                      # ring of `degree` ranks: world ranks group*degree ...
        layout = seqpar.SequenceLayout.packed_for_grid(grid, cu_seqlens_of_docs)
        ... seqpar.MhaCp(grid, layout, causal=True) on this micro-batch ...

Group g of degree d is the world ranks g d .. g d + d - 1 (in the order of `process_group`), so each rank is in
exactly one group of each degree. All groups are made once, by every rank, in ascending degree and group order
(torch.distributed.new_group's rule).
"""

import operator

import torch.distributed as dist

from . import _seqpar
from . import distributed as _distributed


def _error(message, where="seqpar.torch_grid_set"):
    return _seqpar.Error(f"{where}: {message}")


def _plan_error(message):
    return _error(message, "seqpar.check_dynamic_plan")


def _by_value(values):
    """'A on group ranks [0], B on group ranks [1, 2]': the distinct values of a per-rank list, in order of first
    appearance, with the ranks holding each (the same text on every rank: it is made from the gathered table)."""
    groups = []
    for r, v in enumerate(values):
        for g in groups:
            if g[0] == v:
                g[1].append(r)
                break
        else:
            groups.append((v, [r]))
    return ", ".join(f"{v} on group ranks {ranks}" for v, ranks in groups)


def _first_difference(plans):
    """The first micro-batch index where some rank's plan differs from group rank 0's (None when a plan is no list)."""
    if any(not isinstance(p, list) for p in plans):
        return None
    m = min(len(p) for p in plans)
    for i in range(m):
        if any(p[i] != plans[0][i] for p in plans):
            return i
    return m


def _int_or_text(x):
    """x as an int (int, numpy or 0-d torch integers), else its repr ("1.5", "True", "'2'"): the ranks exchange these
    before anything is refused, so that a bad value fails every rank alike instead of one rank leaving the others in
    the collective (int(1.5) and int("12") used to pass silently, True counted as 1)."""
    if isinstance(x, bool):
        return repr(x)
    try:
        return operator.index(x)
    except TypeError:
        return repr(x)


def _ints(values):
    """_int_or_text of each element of `values`, or [repr(values)] when it is a string or not a sequence."""
    if isinstance(values, (str, bytes)):
        return [repr(values)]
    try:
        return [_int_or_text(x) for x in values]
    except TypeError:
        return [repr(values)]


def _plan_entries(plan):
    """The plan's entries as (degree, group, [doc ids]) of _int_or_text values; an entry that is no triple, or a plan
    that is no sequence, as its repr (exchanged like the values, refused after the agreement, on every rank)."""
    if isinstance(plan, (str, bytes)):
        return repr(plan)
    try:
        entries = list(plan)
    except TypeError:
        return repr(plan)
    out = []
    for e in entries:
        try:
            d, g, docs = e
        except (TypeError, ValueError):
            out.append(repr(e))
            continue
        out.append((_int_or_text(d), _int_or_text(g), _ints(docs)))
    return out


def _check_int(value, what, error=_error):
    if isinstance(value, str):
        raise error(f"{what} {value} is not an integer")


class TorchGridSet:
    """Grids of several CP degrees over one process group (see the module docstring)."""

    def __init__(self, degrees, process_group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise _error("torch.distributed is not initialised: call torch.distributed.init_process_group first")
        world = process_group if process_group is not None else dist.group.WORLD
        ranks = list(dist.get_process_group_ranks(world))
        size, me = len(ranks), dist.get_rank(world)
        mine = _ints(degrees)
        table = [None] * size
        dist.all_gather_object(table, mine, group=world)  # agreement first: every later error is every rank's
        if any(t != mine for t in table):
            raise _error(f"ranks disagree on the degrees: {dict(enumerate(table))} (group rank: degrees); every rank "
                         f"must pass the same list")
        if not mine:
            raise _error("no degree given")
        for d in mine:
            _check_int(d, "degree")
            if d < 1 or size % d:
                raise _error(f"degree {d} must divide the world size {size}")
        if len(set(mine)) != len(mine):
            raise _error(f"a degree is given twice in {mine}; one grid per degree")
        self.world_size, self.world_rank, self.degrees = size, me, sorted(mine)
        self._grids = {}
        for d in self.degrees:
            own = None
            for g in range(size // d):
                group = _distributed._new_group(ranks[g * d:(g + 1) * d])
                if g == me // d:
                    own = group
            self._grids[d] = _distributed.torch_grid(process_group=own)

    def grid(self, degree):
        """The grid of `degree` this rank belongs to (a ring of `degree` ranks)."""
        if degree not in self._grids:
            raise _error(f"no grid of degree {degree} (built: {self.degrees})")
        return self._grids[degree]

    def group_of(self, degree):
        """This rank's group of `degree`: it runs the micro-batches (degree, group_of(degree), ...)."""
        self.grid(degree)
        return self.world_rank // degree

    def local(self, plan):
        """Indices of the micro-batches of `plan` ([(degree, group, docs), ...]) this rank runs, in plan order."""
        return [m for m, (d, g, _) in enumerate(plan) if self.group_of(d) == g]


def torch_grid_set(degrees, process_group=None):
    """TorchGridSet(degrees, process_group): collective over the process group (default: the world)."""
    return TorchGridSet(degrees, process_group)


def check_dynamic_plan(grids, doc_lens, plan, process_group=None):
    """Checks a plan on every rank before anything runs: first that every rank holds the same document lengths and
    plan (one all_gather_object), then that every degree has a grid, every group exists, every document is in
    exactly one micro-batch and every micro-batch holds at least one token. Returns the plan as a list of (degree,
    group, [doc ids]). Raises seqpar.Error, the same on every rank."""
    world = process_group if process_group is not None else dist.group.WORLD
    lens = _ints(doc_lens)
    mine = (lens, _plan_entries(plan))
    table = [None] * dist.get_world_size(world)
    dist.all_gather_object(table, mine, group=world)
    # Every message below is made from the gathered table (or from this rank's entry, equal to every rank's once the
    # agreement passed), so every rank raises the same text.
    if any(t[0] != table[0][0] for t in table):
        raise _plan_error(f"ranks disagree on the document lengths: {_by_value([t[0] for t in table])}; every rank "
                          f"must pass the same doc_lens")
    if any(t[1] != table[0][1] for t in table):
        plans = [t[1] for t in table]
        m = _first_difference(plans)
        if m is None:
            raise _plan_error(f"ranks disagree on the plan: {_by_value(plans)}; every rank must pass the same plan")
        raise _plan_error(f"ranks disagree on the plan: micro-batch {m} is {_by_value([p[m:m + 1] for p in plans])}; "
                          f"every rank must pass the same plan")
    if isinstance(mine[1], str):
        raise _plan_error(f"the plan must be a list of (degree, group, [doc ids]), got {mine[1]}")
    for m, e in enumerate(mine[1]):
        if isinstance(e, str):
            raise _plan_error(f"micro-batch {m} = {e} must be a (degree, group, [doc ids]) triple")
    for i, n in enumerate(lens):
        _check_int(n, f"document {i}'s length", _plan_error)
        if n < 0:
            raise _plan_error(f"document {i} has length {n}; lengths must be >= 0")
    for m, (d, g, docs) in enumerate(mine[1]):
        _check_int(d, f"micro-batch {m}'s degree", _plan_error)
        _check_int(g, f"micro-batch {m}'s group", _plan_error)
        for i in docs:
            _check_int(i, f"micro-batch {m}'s document", _plan_error)
    seen = [None] * len(lens)
    for m, (d, g, docs) in enumerate(mine[1]):
        if d not in grids.degrees:
            raise _plan_error(f"micro-batch {m} has degree {d}, which has no grid (degrees {grids.degrees})")
        if not 0 <= g < grids.world_size // d:
            raise _plan_error(f"micro-batch {m} has group {g} of degree {d}; there are {grids.world_size // d}")
        for i in docs:
            if not 0 <= i < len(lens):
                raise _plan_error(f"micro-batch {m} names document {i} of {len(lens)}")
            if seen[i] is not None:
                raise _plan_error(f"document {i} is in micro-batch {seen[i]} and in {m}; every document must be in "
                                  f"exactly one")
            seen[i] = m
    missing = [i for i, s in enumerate(seen) if s is None]
    if missing:
        raise _plan_error(f"documents {missing} are in no micro-batch; every document must be in exactly one")
    # A packed row of no tokens has no layout: its group would fail at packed_for_grid, the other ranks going on.
    for m, (d, g, docs) in enumerate(mine[1]):
        if sum(lens[i] for i in docs) == 0:
            raise _plan_error(f"micro-batch {m} (degree {d}, group {g}) holds no tokens (documents {docs}); every "
                              f"micro-batch must hold at least one token (leave it out of the plan)")
    return mine[1]
