"""CUDA tensors at the Python boundary. A build without CUDA refuses them naming the tensor and the rule, on every
rank, before any message: the tensor here is a DLPack capsule that says kDLCUDA (made with ctypes, never read), so
no GPU is needed. A CUDA build takes them (compiled, never run on a GPU): that case skips with the reason. The MHA
decode layer's cache device (make_cache's device=): its refusals in either build, the host path unchanged."""

import ctypes

import pytest
import torch

import seqpar
from references import check_close, mha_reference
from seqpar import _seqpar

WORLD = seqpar.world().size


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class FakeCudaTensor:
    """An fp32 tensor of `shape` on cuda:`index` as DLPack describes it (dlpack.h's unversioned capsule); the data
    pointer is never dereferenced."""

    def __init__(self, shape, index=0):
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._managed = _DLManagedTensor()
        t = self._managed.dl_tensor
        t.data, t.device, t.ndim = 0x1000, _DLDevice(2, index), len(shape)  # kDLCUDA = 2
        t.dtype, t.shape, t.byte_offset = _DLDataType(2, 32, 1), self._shape, 0  # kDLFloat, 32 bits

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._managed), b"dltensor", None)


@pytest.mark.skipif(_seqpar.with_cuda, reason="a CUDA build takes CUDA tensors (compiled, never run on a GPU)")
def test_build_without_cuda_refuses_cuda_tensors_before_any_message():
    grid = seqpar.CpGrid(ulysses_size=1, ring_size=WORLD)
    layout = seqpar.SequenceLayout.for_grid(grid, seq_len=8 * WORLD)
    layer = _seqpar.MhaCp(grid, layout, _seqpar.MhaCpConfig())
    shape = (1, 8, 2, 8)
    rule = r"but this seqpar was built without CUDA \(SEQPAR_WITH_CUDA=OFF\): its layers take CPU tensors only"
    with pytest.raises(_seqpar.Error, match=r"^rank \d+: q: a CUDA tensor \(cuda:1\), " + rule):
        layer.forward(FakeCudaTensor(shape, 1), FakeCudaTensor(shape), FakeCudaTensor(shape))
    # nothing was sent: the same layer then runs a host call in step on every rank (its agreement check would pair
    # with a message left over from the refused call otherwise)
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape) for _ in range(3))
    out, lse, _ = layer.forward(q, k, v)
    assert out.shape == shape and torch.isfinite(lse).all()


def test_decode_cache_device_refusals_before_any_message():
    """MhaDecodeCp.make_cache's device: a device other than the host or CUDA is refused by name and rule; a CUDA
    cache where no CUDA device is usable names the device and the reason. A host cache (cache.device cpu) refuses
    CUDA inputs to prefill, decode and extend by name on every rank before any message (in a build without CUDA at
    the boundary, in a CUDA build by the cache-device rule): the host prefill and decode after them run in step and
    match the fp64 reference."""
    grid = seqpar.CpGrid(ulysses_size=1, ring_size=WORLD)
    B, HQ, HKV, D, P = 1, 2, 2, 8, 4 * WORLD
    dec = seqpar.MhaDecodeCp(grid)
    with pytest.raises(_seqpar.Error, match=r"device 'meta' is not supported: a decode cache lives on 'cpu' or a "
                                            r"CUDA device \('cuda' or 'cuda:N'\)"):
        dec.make_cache(B, P + 1, HKV, D, torch.float64, device="meta")
    if not torch.cuda.is_available():
        reason = "seqpar was built without CUDA" if not _seqpar.with_cuda else ""
        for device, name in (("cuda", "cuda:0"), (torch.device("cuda", 1), "cuda:1")):
            with pytest.raises(_seqpar.Error, match=rf"make_cache: device {name} is not usable \({reason}"):
                dec.make_cache(B, P + 1, HKV, D, torch.float64, device=device)
    cache = dec.make_cache(B, P + 1, HKV, D, torch.float64)
    assert cache.device == torch.device("cpu")
    layout = seqpar.SequenceLayout.for_grid(grid, P)
    local, one = (B, layout.local_len, HQ, D), (B, 1, HQ, D)

    def refused(name):  # a build without CUDA refuses whichever tensor it views first
        if _seqpar.with_cuda:
            return rf"{name} .* is on cuda:0, but the cache lives on cpu \(pass the inputs on the cache's device"
        return rf"{name}: a CUDA tensor \(cuda:0\), but this seqpar was built without CUDA"

    with pytest.raises(_seqpar.Error, match=refused("[qkv]")):
        dec.layer.prefill(cache, layout, *(FakeCudaTensor(local) for _ in range(3)))
    with pytest.raises(_seqpar.Error, match=refused("[qkv]_new")):
        dec.layer.decode(cache, *(FakeCudaTensor(one) for _ in range(3)))
    with pytest.raises(_seqpar.Error, match=refused("[qkv]")):
        dec.layer.extend(cache, layout, *(FakeCudaTensor(local) for _ in range(3)))
    assert cache.length == 0
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, P + 1, HQ, D, dtype=torch.float64) for _ in range(3))
    ref = mha_reference(q, k, v, causal=True)
    dec.prefill(cache, layout, *(seqpar.shard_sequence(t[:, :P], layout, grid.cp_rank) for t in (q, k, v)))
    out, lse = dec.decode(cache, q[:, P:], k[:, P:], v[:, P:])
    check_close("decode after the refusals", out, ref[:, P:], 1e-10)
    assert out.device == cache.device and cache.length == P + 1
