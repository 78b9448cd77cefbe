"""The Hugging Face tests under mpirun, with python/tests' rules (a failure on one rank aborts the job at once:
python/tests/conftest.py) and python/tests on the path for references.py."""

import os
import sys

import pytest
import torch

import seqpar

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


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
