"""The Hugging Face tests under mpirun or torchrun (launch.py), with python/tests' rules (a failure on one rank
stops the job at once) and python/tests on the path for references.py. Under torchrun: gloo, and at the end a check
that MPI was never initialised and mpi4py never imported."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import launch  # noqa: E402
import seqpar  # noqa: E402


def pytest_runtest_logreport(report):
    if report.failed and launch.world_size() > 1:
        sys.stderr.write(f"rank {launch.rank()}: {report.nodeid} failed:\n{report.longreprtext}\n")
        sys.stderr.flush()
        launch.abort(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    torch.set_num_threads(1)
    launch.init()


def pytest_sessionfinish(session, exitstatus):
    if launch.TORCHRUN:
        assert not seqpar._seqpar.mpi_initialized(), "MPI was initialised under torchrun"
        assert "mpi4py" not in sys.modules, "mpi4py was imported under torchrun"
        seqpar.distributed.clear_grid_cache()
        torch.distributed.destroy_process_group()
