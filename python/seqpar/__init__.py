"""seqpar for PyTorch: sequence-parallel (context-parallel) attention layers as autograd functions and modules.

The layers run seqpar's C++ CP layers (ring attention, Ulysses, USP for MHA / GQA; DeepSeek sparse attention;
gated delta rule with its short conv) on CPU tensors under mpirun, without copying the tensors (DLPack).
docs/python.md shows the installs and a training example; docs/design.md, "Python module" the design.

    import seqpar
    grid = seqpar.CpGrid(dp_size=1, ulysses_size=2, ring_size=2)        # over the MPI world (or comm=<mpi4py comm>)
    layout = seqpar.SequenceLayout.for_grid(grid, seq_len=4096)          # zigzag by default
    x_local = seqpar.shard_sequence(x_full, layout, grid.cp_rank)        # [B, S / 4, ...], differentiable
    attn = seqpar.MhaCp(grid, layout, seqpar.MhaCpConfig(causal=True))
    out = attn(q, k, v)                                                  # local [B, S / 4, Hq, D]

Uncaught exceptions under mpirun: an exception that reaches the top level on one rank would leave the other ranks
waiting in their next collective until SEQPAR_COMM_TIMEOUT_S. `seqpar.install_mpi_excepthook()` chains an
`sys.excepthook` that prints the exception as Python does and then stops the whole job (MPI_Abort) when the MPI world
has more than one rank. `import seqpar` installs it by itself only when the process was started by an MPI launcher
for more than one rank (OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_SIZE in the environment, e.g. `mpirun -np 4`); a
single process, a notebook or a plain `python` run keeps Python's own hook. SEQPAR_PYTHON_ABORT=0 never installs it,
SEQPAR_PYTHON_ABORT=1 always does; `seqpar.uninstall_mpi_excepthook()` restores the previous hook.
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
    MhaCpConfig,
    SequenceLayout,
    ShortConvCpConfig,
    CpGrid,
    __version__,
    abort,
    alibi_slopes,
    from_mpi4py,
    world,
)
from .layers import (  # noqa: F401
    DsaCp,
    DsaFunction,
    GdnCp,
    GdnFunction,
    ShortConvCp,
    ShortConvFunction,
    MhaCp,
    MhaCpFunction,
)
from .decode import DsaDecodeCp, GdnDecodeCp, MhaDecodeCp  # noqa: F401
from .rope import apply_rope, rope_cos_sin  # noqa: F401
from .sequence import gather_sequence, scatter_sequence, shard_sequence  # noqa: F401
from .distributed import all_reduce_cp_gradients, torch_grid  # noqa: F401
from .dynamic import TorchGridSet, check_dynamic_plan, torch_grid_set  # noqa: F401
from .loss import shard_labels, sharded_cross_entropy, shift_labels  # noqa: F401

# MPI: initialised by the first communicator (seqpar.world(), CpGrid) unless the program (or mpi4py) did it first;
# finalised at exit only when seqpar initialised it.
_atexit.register(_seqpar.finalize)

# Uncaught exceptions under mpirun (the docstring above): MPI_Abort instead of leaving the other ranks waiting.
_previous_excepthook = None
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def _abort_on_uncaught(exc_type, exc, tb):
    (_previous_excepthook or _sys.__excepthook__)(exc_type, exc, tb)
    if _seqpar.mpi_initialized() and world().size > 1:
        _sys.stderr.flush()
        _sys.stdout.flush()
        abort(1)


def install_mpi_excepthook():
    """Make an uncaught exception stop the whole MPI job: print it with the hook in place before, then call
    seqpar.abort(1) (MPI_Abort) when MPI is initialised and the world has more than one rank. Idempotent."""
    global _previous_excepthook
    if _sys.excepthook is not _abort_on_uncaught:
        _previous_excepthook = _sys.excepthook
        _sys.excepthook = _abort_on_uncaught


def uninstall_mpi_excepthook():
    """Restore the sys.excepthook that install_mpi_excepthook() replaced (nothing if it is not installed)."""
    global _previous_excepthook
    if _sys.excepthook is _abort_on_uncaught:
        _sys.excepthook = _previous_excepthook or _sys.__excepthook__
        _previous_excepthook = None


def _launched_by_mpi_with_peers():
    for name in _LAUNCHER_SIZE_VARS:
        try:
            if int(_os.environ.get(name, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


_abort_setting = _os.environ.get("SEQPAR_PYTHON_ABORT", "")
if _abort_setting == "1" or (_abort_setting != "0" and _launched_by_mpi_with_peers()):
    install_mpi_excepthook()
