"""Hostile input at the Python boundary: each case raises seqpar.Error on every rank, naming the value and the rule
(never a bare BufferError, ZeroDivisionError, pybind11 cast error or a misleading message), and nothing hangs."""

import pytest
import torch

import seqpar

WORLD = seqpar.world().size
S = 8 * WORLD


def _grid_layout():
    grid = seqpar.CpGrid(1, 1, WORLD)
    return grid, seqpar.SequenceLayout.for_grid(grid, S)


@pytest.mark.parametrize("shape, rule", [((0, 4), r"heads: Hq 0 must be a positive multiple of Hkv 0"),
                                         ((2, 0), r"head_dim \(q dim 3\) must be > 0, got 0")])
def test_mha_empty_heads_or_head_dim_name_the_dimension(shape, rule):
    """torch gives tensors without elements strides that are not row-major: they must not read as 'not
    contiguous'; the layer names the empty dimension."""
    grid, layout = _grid_layout()
    q = torch.randn(1, layout.local_len, *shape)
    with pytest.raises(seqpar.Error, match=rule):
        seqpar.MhaCp(grid, layout)(q, q, q)


def test_meta_tensors_name_the_tensor_and_device():
    grid, layout = _grid_layout()
    q = torch.empty(1, layout.local_len, 2, 4, device="meta")
    with pytest.raises(seqpar.Error, match=r"[qkv]: a tensor on device 'meta' cannot be viewed through DLPack"):
        seqpar.MhaCp(grid, layout)(q, q, q)


@pytest.mark.parametrize("bad", ["numpy", "list"])
def test_inputs_that_are_not_tensors_are_named(bad):
    grid, layout = _grid_layout()
    q = torch.randn(1, layout.local_len, 2, 4)
    k = q.numpy() if bad == "numpy" else q.tolist()
    with pytest.raises(seqpar.Error, match=rf"MhaCp: k must be a torch.Tensor, got {'numpy.ndarray' if bad == 'numpy' else 'builtins.list'}"):
        seqpar.MhaCp(grid, layout)(q, k, q)
    with pytest.raises(seqpar.Error, match=r"GdnCp: beta must be a torch.Tensor"):
        seqpar.GdnCp(grid, layout)(q, q, q, torch.zeros(1, layout.local_len, 2), k)


@pytest.mark.parametrize("cu, rule", [
    (torch.tensor([0.0, 4.0, S]), r"cu_seqlens\[0\] = 0.0 is not an int"),
    ([0, 4.5, S], r"cu_seqlens\[1\] = 4.5 is not an int"),
    (torch.tensor([[0, 4, S]]), r"cu_seqlens\[0\] = \[0, 4, \d+\] is not an int"),
    ([0, 2**63], r"cu_seqlens\[1\] = 9223372036854775808 does not fit in int64"),
    ("0,4,8", r"cu_seqlens: expected a list of ints or a 1-D integer tensor, got str"),
    (torch.tensor([0, 4, S], device="meta"), r"cu_seqlens: the values of a tensor on device 'meta' cannot be read"),
])
def test_cu_seqlens_of_the_wrong_kind_are_named(cu, rule):
    grid, _ = _grid_layout()
    with pytest.raises(seqpar.Error, match=rule):
        seqpar.SequenceLayout.packed_for_grid(grid, cu)


def test_cu_seqlens_int32_tensor_is_the_same_layout_as_int64():
    grid, _ = _grid_layout()
    a = seqpar.SequenceLayout.packed_for_grid(grid, torch.tensor([0, 3, S], dtype=torch.int32))
    b = seqpar.SequenceLayout.packed_for_grid(grid, [0, 3, S])
    assert torch.equal(a.token_index(grid.cp_rank), b.token_index(grid.cp_rank))
    assert a.padded_len == b.padded_len and a.num_docs == b.num_docs == 2


@pytest.mark.parametrize("field, value", [("width", 0), ("width", -2), ("channels", -4), ("channels", 0),
                                          ("width", 2.5)])
def test_short_conv_sizes_are_checked(field, value):
    grid, layout = _grid_layout()
    kwargs = {"channels": 4, "width": 4, field: value}
    with pytest.raises(seqpar.Error, match=rf"ShortConvCp: {field}={value!r} must be an int >= 1"):
        seqpar.ShortConvCp(grid, layout, **kwargs)


@pytest.mark.parametrize("empty", ["H", "Hi", "Di"])
def test_dsa_empty_heads_or_indexer_dims_are_refused(empty):
    """Zero indexer heads or dims would give all-zero index scores (an arbitrary selection) without a word."""
    grid, layout = _grid_layout()
    n = layout.local_len
    h, hi, di = (0 if empty == "H" else 2), (0 if empty == "Hi" else 2), (0 if empty == "Di" else 4)
    args = (torch.randn(1, n, h, 8), torch.randn(1, n, 8), torch.randn(1, n, hi, di), torch.randn(1, n, di),
            torch.randn(1, n, hi))
    with pytest.raises(seqpar.Error, match=rf"heads H {h}, head dim Dqk 8, indexer heads Hi {hi} and indexer dim Di "
                                           rf"{di} must all be >= 1"):
        seqpar.DsaCp(grid, layout, topk=4, dim_v=4)(*args)


@pytest.mark.parametrize("weight", ["abc", float("nan"), float("inf")])
def test_dsa_indexer_loss_weight_is_checked_when_made(weight):
    grid, layout = _grid_layout()
    with pytest.raises(seqpar.Error, match=r"DsaCp: indexer_loss_weight=.* must be"):
        seqpar.DsaCp(grid, layout, topk=4, dim_v=4, indexer_loss_weight=weight)


@pytest.mark.parametrize("layer", ["GdnCp", "GdnDecodeCp"])
def test_gdn_chunk_size_below_one_is_refused_when_made(layer):
    """Both GDN layers refuse chunk_size 0 at construction (GdnDecodeCp refused it only at the first prefill)."""
    grid, layout = _grid_layout()
    with pytest.raises(seqpar.Error, match=r"chunk_size 0 must be >= 1"):
        if layer == "GdnCp":
            seqpar.GdnCp(grid, layout, chunk_size=0)
        else:
            seqpar.GdnDecodeCp(grid, value_heads=WORLD, key_heads=WORLD, chunk_size=0)


@pytest.mark.skipif(WORLD != 1, reason="one subprocess is enough (the np1 run checks it)")
def test_layout_of_a_huge_ring_fails_cleanly_instead_of_crashing():
    """A ring of 2^16 ranks: the layout's ring_size x ring_size table of per-step work overflowed int (an empty table
    written out of bounds: a segfault). Under a 4 GiB address-space limit the 32 GiB table must now fail to allocate
    (MemoryError), not crash."""
    import subprocess
    import sys
    code = ("import resource, seqpar\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "try:\n"
            "    seqpar.SequenceLayout('contiguous', 16384, 65536)\n"
            "except MemoryError:\n"
            "    print('MemoryError')\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "MemoryError" in out.stdout, (out.returncode, out.stdout, out.stderr[-2000:])


def test_gdn_empty_batch_names_the_batch():
    """A batch of 0 used to fail deep inside (swap_outer_dims: '... divisible by 0 x 2')."""
    grid, layout = _grid_layout()
    q = torch.randn(0, layout.local_len, 2, 4)
    g = -torch.rand(0, layout.local_len, 2)
    with pytest.raises(seqpar.Error, match=r"GDN CP: batch B = 0 .* must be >= 1"):
        seqpar.GdnCp(grid, layout)(q, q, q, g, torch.rand(0, layout.local_len, 2))


@pytest.mark.parametrize("cu", [None, [0, 1, 2**62]])
def test_layout_of_an_impossible_length_names_the_rule(cu):
    """2^62 tokens used to end in a bare ValueError('vector::reserve')."""
    grid, _ = _grid_layout()
    with pytest.raises(seqpar.Error, match=r"seq_len 4611686018427387904 must be <= 2\^48"):
        if cu is None:
            seqpar.SequenceLayout.for_grid(grid, 2**62)
        else:
            seqpar.SequenceLayout.packed_for_grid(grid, cu)


def _other_ranks_differ():
    return seqpar.world().rank == WORLD - 1


@pytest.mark.skipif(WORLD == 1, reason="ranks that disagree need two")
@pytest.mark.parametrize("layer", ["mha", "gdn", "short_conv", "dsa", "no_grad"])
def test_ranks_that_disagree_on_a_backward_stop_in_the_forward(layer):
    """The last rank's inputs need no gradient (or it runs under no_grad): it would never call the backward the other
    ranks wait in (a hang until SEQPAR_COMM_TIMEOUT_S). Every rank stops in the forward, naming the field."""
    grid, layout = _grid_layout()
    n = layout.local_len
    differs = _other_ranks_differ()
    grad = not differs or layer == "no_grad"
    q = torch.randn(1, n, 2, 4, requires_grad=grad)
    rule = rf"\(Python\): the ranks of the cp group .* disagree on backward \(grad mode on and an input that " \
           rf"requires grad\): yes on cp ranks? 0[\d, ]*; no on cp rank {WORLD - 1}\."
    with pytest.raises(seqpar.Error, match=rule), torch.set_grad_enabled(not (layer == "no_grad" and differs)):
        if layer in ("mha", "no_grad"):
            seqpar.MhaCp(grid, layout)(q, q.detach(), q.detach()).sum().backward()
        elif layer == "gdn":
            x = q.detach()
            seqpar.GdnCp(grid, layout)(q, x, x, -torch.rand(1, n, 2), torch.rand(1, n, 2))[0].sum().backward()
        elif layer == "short_conv":
            conv = seqpar.ShortConvCp(grid, layout, channels=4)
            conv.weight.requires_grad_(grad)
            conv(torch.randn(1, n, 4)).sum().backward()
        else:
            args = (torch.randn(1, n, 2, 8, requires_grad=grad), torch.randn(1, n, 8), torch.randn(1, n, 2, 4),
                    torch.randn(1, n, 4), torch.rand(1, n, 2))
            seqpar.DsaCp(grid, layout, topk=4, dim_v=4, indexer_loss_weight=1.0)(*args).sum().backward()


@pytest.mark.skipif(WORLD == 1, reason="ranks that disagree need two")
def test_ranks_that_disagree_on_the_dsa_loss_mode_stop_in_the_forward():
    """indexer_loss_weight=None runs a backward inside the forward (for the loss value), a weight does not: ranks that
    differ would pair that backward's messages with the next call's (a hang until SEQPAR_COMM_TIMEOUT_S)."""
    grid, layout = _grid_layout()
    n = layout.local_len
    args = (torch.randn(1, n, 2, 8), torch.randn(1, n, 8), torch.randn(1, n, 2, 4), torch.randn(1, n, 4),
            torch.rand(1, n, 2))
    weight = 0.5 if _other_ranks_differ() else None
    rule = rf"DsaCp \(Python\): .* disagree on indexer_loss: returned on cp ranks? 0[\d, ]*; trained at weight 0.5 " \
           rf"on cp rank {WORLD - 1}\."
    with pytest.raises(seqpar.Error, match=rule):
        seqpar.DsaCp(grid, layout, topk=4, dim_v=4, indexer_loss_weight=weight)(*args)


def test_a_layer_that_agreed_runs_its_backward():
    """The check passes ranks that agree (every rank needs a gradient): the backward runs, and a repeated call sends
    no second check (the cache)."""
    grid, layout = _grid_layout()
    q = torch.randn(1, layout.local_len, 2, 4, requires_grad=True)
    m = seqpar.MhaCp(grid, layout)
    for _ in range(2):
        m(q, q, q).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert m._agreement.num_checks == (1 if WORLD > 1 else 0)


def test_a_tensor_with_the_negative_bit_is_refused_by_name():
    """torch._neg_view sets a lazy negation that DLPack does not carry: the layer computed on -x without a word."""
    grid, layout = _grid_layout()
    q = torch.randn(1, layout.local_len, 2, 4)
    with pytest.raises(seqpar.Error, match=r"k: the tensor has torch's negative bit set .* call .resolve_neg\(\) first"):
        seqpar.MhaCp(grid, layout)(q, q._neg_view(), q)


class _NegViewGrad(torch.autograd.Function):
    """Identity whose backward hands over the incoming gradient as -(-g) through a negative-bit view."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (-g)._neg_view()


def test_an_incoming_gradient_with_the_negative_bit_is_resolved():
    """Autograd may hand a layer's backward a negative-bit view: it is resolved (the gradients equal those of the
    plain incoming gradient), not read as its raw memory."""
    grid, layout = _grid_layout()
    q = torch.randn(1, layout.local_len, 2, 4, requires_grad=True)
    m = seqpar.MhaCp(grid, layout)
    weight = torch.randn(1, layout.local_len, 2, 4)
    (_NegViewGrad.apply(m(q, q, q)) * weight).sum().backward()
    got, q.grad = q.grad, None
    (m(q, q, q) * weight).sum().backward()
    torch.testing.assert_close(got, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(2, 5), (2,)])
def test_apply_rope_names_an_odd_head_dim_or_a_missing_head_dim(shape):
    """An odd D failed in torch's broadcasting ('size of tensor a (5) must match ... (6)'); a 3-D x without heads
    broadcast its rows against the positions (a wrong result or the same broadcasting error)."""
    grid, layout = _grid_layout()
    x = torch.randn(1, layout.local_len, *shape)
    with pytest.raises(ValueError, match=r"apply_rope: x of shape .* must be \[B, S_local, H, D\] with an even head_dim"):
        seqpar.apply_rope(x, layout, grid.cp_rank)
