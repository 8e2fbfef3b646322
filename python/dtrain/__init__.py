"""dtrain as a torch.distributed backend.

    import dtrain                                  # registers the "dtrain" backend
    import torch.distributed as dist
    dist.init_process_group("dtrain")              # under torchrun, as with "gloo"

On torch 2.15 and later the package also declares the ``torch.distributed.backends`` entry point, so
``init_process_group("dtrain")`` works without the import. docs/PYTHON.md says what is supported.
"""
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["register", "built_for_torch", "version"]


def _minor(v):
    return tuple(int(x) for x in v.split("+")[0].split(".")[:2])


try:
    from . import _C
except ImportError as e:  # a build for another torch: its symbols are missing
    raise ImportError(
        f"dtrain's extension could not be loaded with torch {torch.__version__}: {e}. dtrain must be built "
        f"against the torch it runs with: reinstall it in this environment (pip install --no-build-isolation ./python)"
    ) from e

built_for_torch = _C.torch_version
version = _C.version
if _minor(built_for_torch) != _minor(torch.__version__):
    raise ImportError(
        f"dtrain was built against torch {built_for_torch}, but torch {torch.__version__} is installed: "
        f"a c10d backend is tied to one torch minor version; reinstall dtrain in this environment "
        f"(pip install --no-build-isolation ./python)"
    )


def _create(opts, backend_options=None):
    # extended_api=True: torch passes _DistributedBackendOptions (store, group_rank, group_size, timeout,
    # group_id, ...).
    timeout = opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    return _C.create_backend(opts.store, opts.group_rank, opts.group_size, timeout, str(opts.group_id or ""))


def register():
    """Registers the "dtrain" backend with torch.distributed (done on import; a second call does nothing)."""
    if "dtrain" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("dtrain", _create, extended_api=True, devices=["cpu", "cuda"])


register()
