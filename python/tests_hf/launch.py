"""The two launches of the Hugging Face tests: mpirun (the MPI world, seqpar.CpGrid) or torchrun (torch.distributed
over gloo, the grid from a ProcessGroup or a DeviceMesh; MPI is never initialised and mpi4py never imported)."""

import os

import torch.distributed as dist

import seqpar

# torchrun's agent sets TORCHELASTIC_RUN_ID in every worker's environment; mpirun does not.
TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ

_meshes = {}


def init():
    if TORCHRUN and not dist.is_initialized():
        dist.init_process_group("gloo")


def world_size():
    return dist.get_world_size() if TORCHRUN else seqpar.world().size


def rank():
    return dist.get_rank() if TORCHRUN else seqpar.world().rank


def grid(ulysses_size, ring_size):
    """The CP grid of ulysses_size x ring_size over the whole job: seqpar.CpGrid under mpirun; under torchrun the
    default group (ring attention over it) when ulysses_size is 1, otherwise a DeviceMesh (ring, ulysses)."""
    if not TORCHRUN:
        return seqpar.CpGrid(1, ulysses_size, ring_size)
    if ulysses_size == 1:
        return seqpar.torch_grid(process_group=dist.group.WORLD)
    mesh = _meshes.get((ulysses_size, ring_size))
    if mesh is None:  # every rank makes the meshes in the same order (the tests run in the same order everywhere)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (ring_size, ulysses_size), mesh_dim_names=("ring", "ulysses"))
        _meshes[(ulysses_size, ring_size)] = mesh
    return seqpar.torch_grid(device_mesh=mesh, ulysses_dim="ulysses", ring_dim="ring")


def abort(code):
    """Stops the whole job at once: MPI_Abort under mpirun; under torchrun this process exits and the agent stops
    the other workers."""
    if TORCHRUN:
        os._exit(code)
    seqpar.abort(code)
