"""ckptio: atomic, verified checkpoints for PyTorch trainers.

    import ckptio
    ckpt = ckptio.Checkpointer("/ckpt/run42", wait="file-lock", keep_last=3)
    state = {"model": model, "optim": optimizer, "epoch": 0}
    step = ckpt.load(state)          # the same step on every rank; None: nothing saved yet
    for step in range(0 if step is None else step + 1, steps):
        ...
        if step % 500 == 0:
            ckpt.save(step, state)   # rank 0 writes; the others return once it is committed

Rank 0 writes each step to temporary files, fsyncs them, records XXH3
checksums and commits it atomically; the other ranks wait (file lock,
manifest or the c10d store) and never read an uncommitted step; every load
verifies every byte and falls back, loudly, to the newest good step. The
protocol is the C++ core's (``ckptio._ckptio``); this package turns a
trainer's state into it. The format is the C++ Checkpointer's: each steps
opens in either language. No pickle: a load never runs code from the store.
"""
import inspect
import os

import torch  # first: the extension links LibTorch's Python bindings

from . import _state
from ._ckptio import RankInfo
from ._ckptio import Checkpointer as _CoreCheckpointer
from ._errors import (AbortedError, AlreadyExistsError, DataLossError,  # noqa: F401
                      DeadlineExceededError, Error, FailedPreconditionError, InternalError,
                      InvalidArgumentError, NotFoundError, PermissionDeniedError,
                      ResourceExhaustedError, UnavailableError, UnimplementedError,
                      WriterDiedError)

__all__ = ["Checkpointer", "RankInfo", "rank_info", "Error", "DataLossError",
           "WriterDiedError", "DeadlineExceededError", "InvalidArgumentError", "NotFoundError"]

_WAITS = ("manifest", "file-lock", "store")


def rank_info():
    """Who this process is: torch.distributed's rank and world size when it
    is initialized, checked against the launcher's environment (RANK,
    LOCAL_RANK, WORLD_SIZE, ... of torchrun or ckptio-launch; Slurm; Open
    MPI), which also gives the local rank and the job id."""
    info = RankInfo.from_env()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if info.source == "single" and world > 1:
            raise InvalidArgumentError(
                f"torch.distributed says rank {rank} of {world}, but the environment names "
                "no launch (RANK, WORLD_SIZE, LOCAL_RANK...): start the job with "
                "torchrun or ckptio-launch, or set those variables")
        if (info.rank, info.world_size) != (rank, world):
            raise InvalidArgumentError(
                f"torch.distributed says rank {rank} of {world}, the environment "
                f"{info.rank} of {info.world_size} ({info.source})")
    return info


def _map_location(map_location):
    """torch.load's map_location forms, as the core takes them: None (auto:
    cuda:LOCAL_RANK when CUDA is there, else CPU), a device string, or a
    function of the saved device's string returning a device string."""
    if map_location is None:
        return None
    if isinstance(map_location, torch.device):
        return str(map_location)
    if isinstance(map_location, str):
        return map_location
    if isinstance(map_location, dict):
        table = {str(k): str(v) for k, v in map_location.items()}
        return lambda saved: table.get(saved, saved)
    if callable(map_location):
        # torch.load calls fn(storage, location); ckptio has no storage to
        # give: a two-argument function gets None for it.
        try:
            params = inspect.signature(map_location).parameters.values()
            two = len([p for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]) >= 2
        except (TypeError, ValueError):  # (a builtin without a signature)
            two = False
        return (lambda saved: str(map_location(None, saved))) if two else (
            lambda saved: str(map_location(saved)))
    raise InvalidArgumentError(f"map_location {map_location!r}: give None, a device string, a "
                               "torch.device, a dict or a function")


class Checkpointer:
    """Checkpoints of a data-parallel job in the store at ``uri`` (a path,
    ``file://`` or ``nfs://`` URI).

    wait: how the ranks that do not write learn of a commit: "file-lock"
        (rank 0 holds a lock while it saves: a dead rank 0 is seen at once),
        "manifest" (polling, any backend) or "store" (torch.distributed's
        c10d store, or ``store=``).
    keep_last: steps kept (0: all). timeout: seconds any wait may last.
    Every rank opens its Checkpointers in the same order and makes the same
    save and load calls, like collectives.
    """

    def __init__(self, uri, wait="file-lock", keep_last=0, timeout=600.0, store=None,
                 rank=None, stripe=False, max_staging_bytes=4 << 30):
        if wait not in _WAITS:
            raise InvalidArgumentError(f"wait={wait!r}: one of {', '.join(_WAITS)}")
        if wait == "store" and store is None:
            dist = torch.distributed
            if not (dist.is_available() and dist.is_initialized()):
                raise InvalidArgumentError(
                    'wait="store" needs torch.distributed initialized, or store=')
            store = dist.distributed_c10d._get_default_store()
        self._core = _CoreCheckpointer(os.fspath(uri), rank or rank_info(), wait, store,
                                       int(keep_last), float(timeout), bool(stripe),
                                       int(max_staging_bytes))

    @property
    def rank(self):
        return self._core.rank

    def save(self, step, state):
        """Rank 0 writes and commits ``step``; every other rank returns once
        it is committed. Raises on failure (on the waiting ranks too)."""
        plan = _state.plan_save(state)
        self._core.save(int(step), plan.modules, plan.tensors, plan.metadata)

    def load(self, state, step=None, map_location=None):
        """Loads into ``state`` on every rank: the step rank 0 chose (the
        newest that verifies, skipping damaged ones with a warning), or
        ``step``. Modules are filled in place, objects with state_dict()
        get load_state_dict(), other entries are replaced. Returns the step
        loaded, or None when the store holds no checkpoint yet (the state
        is left as it is). All or nothing: when the step does not fit the
        state, it raises and nothing changed."""
        decoded = {}

        def check(metadata, tensors):
            decoded.update(_state.decode_step(state, metadata, tensors))

        got, _skipped, _tensors, _metadata = self._core.load(
            _state.module_request(state), step, _map_location(map_location), check)
        if got is not None:
            _state.apply(state, decoded)
        return got
