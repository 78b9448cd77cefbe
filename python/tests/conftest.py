"""pytest under mpirun: every rank runs the same tests in the same order (each test is collective over the world).

A failure on one rank must not leave the others waiting in their next collective: the failed rank prints its
report and stops the job with MPI_Abort (seqpar.abort), so mpirun exits non-zero at once. A failure on every rank
(a seqpar.Error raised on all of them) aborts the same way.
"""

import sys

import pytest
import torch

import seqpar


def pytest_runtest_logreport(report):
    if report.failed and seqpar.world().size > 1:
        sys.stderr.write(f"rank {seqpar.world().rank}: {report.nodeid} failed:\n{report.longreprtext}\n")
        sys.stderr.flush()
        seqpar.abort(1)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    torch.set_num_threads(1)
