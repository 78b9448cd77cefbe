"""seqpar for PyTorch: sequence-parallel (context-parallel) attention layers as autograd functions and modules.

The layers run seqpar's C++ CP layers (ring attention, Ulysses, USP for MHA / GQA; DeepSeek sparse attention;
gated delta rule with its short conv) on CPU tensors under mpirun, without copying the tensors (DLPack).
README "Python / PyTorch" shows the installs and a training example; docs/design.md section 17 the design.

    import seqpar
    grid = seqpar.SpGrid(dp_size=1, ulysses_size=2, ring_size=2)        # over the MPI world (or comm=<mpi4py comm>)
    layout = seqpar.SequenceLayout.for_grid(grid, seq_len=4096)          # zigzag by default
    x_local = seqpar.shard_sequence(x_full, layout, grid.sp_rank)        # [B, S / 4, ...], differentiable
    attn = seqpar.UspAttention(grid, layout, seqpar.RingAttentionConfig(causal=True))
    out = attn(q, k, v)                                                  # local [B, S / 4, Hq, D]
"""

import atexit as _atexit
import os as _os
import sys as _sys

import torch  # noqa: F401  (the C++ module hands its outputs to torch.from_dlpack)

from . import _seqpar
from ._seqpar import (  # noqa: F401
    Communicator,
    Context,
    DsaCpConfig,
    Error,
    GdnCpConfig,
    RingAttentionConfig,
    SequenceLayout,
    ShortConvCpConfig,
    SpGrid,
    __version__,
    abort,
    from_mpi4py,
    world,
)
from .layers import (  # noqa: F401
    DsaContextParallel,
    DsaFunction,
    GdnContextParallel,
    GdnFunction,
    ShortConvContextParallel,
    ShortConvFunction,
    UspAttention,
    UspAttentionFunction,
)
from .sequence import gather_sequence, scatter_sequence, shard_sequence  # noqa: F401

# MPI: initialised by the first communicator (seqpar.world(), SpGrid) unless the program (or mpi4py) did it first;
# finalised at exit only when seqpar initialised it.
_atexit.register(_seqpar.finalize)

# An uncaught exception on one rank stops the whole job (MPI_Abort) instead of leaving the other ranks waiting in
# their next collective until SEQPAR_COMM_TIMEOUT_S. SEQPAR_PYTHON_ABORT=0 keeps Python's own hook.
_previous_excepthook = _sys.excepthook


def _abort_on_uncaught(exc_type, exc, tb):
    _previous_excepthook(exc_type, exc, tb)
    if _seqpar.mpi_initialized() and world().size > 1:
        _sys.stderr.flush()
        _sys.stdout.flush()
        abort(1)


if _os.environ.get("SEQPAR_PYTHON_ABORT", "1") != "0":
    _sys.excepthook = _abort_on_uncaught
