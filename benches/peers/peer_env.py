"""Shared by the PyTorch peer drivers in benches/peers/. Import it before torch and numpy:

    import peer_env  # noqa: F401  (first: one compute thread per rank, BLAS included)
    import torch

Every rank gets one compute thread, as dtrain's ranks have (dtrain-run sets OMP_NUM_THREADS=1).
torch.set_num_threads(1) alone is not enough: OpenBLAS and MKL size their own thread pools from
these variables when the library is loaded, so without them a one-rank run used every core (and
looked 1.4x faster than one thread is) and two ranks oversubscribed the machine. The variables are
set in os.environ, so the ranks that torch.multiprocessing spawns inherit them too.
"""
import ctypes
import os
import socket

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"


def free_port():
    """A TCP port that was free a moment ago, for the ranks' rendezvous on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blas_threads():
    """The thread count of the OpenBLAS loaded into this process, or None if none is loaded."""
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "openblas" in line.split()[-1]})
    for lib in libs:
        try:
            return ctypes.CDLL(lib).openblas_get_num_threads()
        except (OSError, AttributeError):
            continue
    return None


def check_threads(torch):
    """Pins torch's intra-op pool to one thread and raises unless torch and OpenBLAS both run one."""
    torch.set_num_threads(1)
    blas = blas_threads()
    if torch.get_num_threads() != 1 or blas not in (None, 1):
        raise RuntimeError(f"peer_env: expected one compute thread per rank, got torch {torch.get_num_threads()}, "
                           f"OpenBLAS {blas} (was torch or numpy imported before peer_env?)")
