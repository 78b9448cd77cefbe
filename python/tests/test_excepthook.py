"""The MPI excepthook: installed at import only under an MPI launcher with more than one rank, or on request."""

import os
import sys

import seqpar


def _launcher_size():
    return max(int(os.environ.get(name, "1")) for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"))


def test_import_installs_the_hook_only_under_a_launcher_with_peers():
    setting = os.environ.get("SEQPAR_PYTHON_ABORT", "")
    expected = setting == "1" or (setting != "0" and _launcher_size() > 1)
    assert (sys.excepthook is seqpar._abort_on_uncaught) == expected


def test_install_and_uninstall_restore_the_previous_hook():
    before = sys.excepthook
    seqpar.uninstall_mpi_excepthook()
    plain = sys.excepthook
    assert plain is not seqpar._abort_on_uncaught
    seqpar.install_mpi_excepthook()
    seqpar.install_mpi_excepthook()  # idempotent: the previous hook is still the plain one
    assert sys.excepthook is seqpar._abort_on_uncaught
    seqpar.uninstall_mpi_excepthook()
    assert sys.excepthook is plain
    if before is seqpar._abort_on_uncaught:
        seqpar.install_mpi_excepthook()
    assert sys.excepthook is before
