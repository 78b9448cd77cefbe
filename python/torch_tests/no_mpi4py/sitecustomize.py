"""Makes `import mpi4py` fail in this interpreter, as if mpi4py were not installed (put this directory on
PYTHONPATH): the torchrun tests show that seqpar's torch.distributed path needs neither mpi4py nor MPI."""

import importlib.abc
import sys


class _NoMpi4py(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ModuleNotFoundError(f"No module named '{name}' (blocked by the seqpar torchrun tests)", name=name)
        return None


sys.meta_path.insert(0, _NoMpi4py())
