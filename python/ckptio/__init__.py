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

from . import _ckptio, _state
from ._ckptio import RankInfo
from ._errors import (AbortedError, AlreadyExistsError, DataLossError,  # noqa: F401
                      DeadlineExceededError, Error, FailedPreconditionError, InternalError,
                      InvalidArgumentError, NotFoundError, PermissionDeniedError,
                      ResourceExhaustedError, UnavailableError, UnimplementedError,
                      WriterDiedError)

__all__ = ["Checkpointer", "SaveFuture", "save", "load", "RankInfo", "rank_info", "Error",
           "DataLossError", "WriterDiedError", "DeadlineExceededError", "InvalidArgumentError",
           "NotFoundError"]

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


class _Storage:
    """What a two-argument map_location function gets as its storage.
    torch.load passes the storage as deserialized, on the CPU, and takes
    back the storage to use: unchanged (the CPU), moved (``.cuda(i)``,
    ``.cpu()``, ``.to(device)``) or None (where it was saved). ckptio
    decides devices before it reads anything, so this stands in for the
    storage and records where the function sends it."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def cpu(self):
        return _Storage("cpu")

    def cuda(self, device=None, non_blocking=False, **kwargs):
        if device is None:
            device = torch.cuda.current_device()
        return _Storage(torch.device("cuda", device) if isinstance(device, int) else device)

    def to(self, device, *args, **kwargs):
        return _Storage(device)


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
        try:
            params = inspect.signature(map_location).parameters.values()
            two = len([p for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]) >= 2
        except (TypeError, ValueError):  # (a builtin without a signature)
            two = False

        def target(saved):
            out = map_location(_Storage(), saved) if two else map_location(saved)
            if out is None:  # torch.load: restore where it was saved
                return saved
            return str(out.device) if isinstance(out, _Storage) else str(out)
        return target
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
        self._core = _ckptio.Checkpointer(os.fspath(uri), rank or rank_info(), wait, store,
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

    def save_async(self, step, state):
        """Like save, but rank 0 returns as soon as the state is copied
        (into staging memory reused from save to save, at most
        ``max_staging_bytes``; a larger state is saved synchronously, with a
        warning) and writes and commits on a background thread; the other
        ranks return at once. Training may change the state as soon as it
        returns. The SaveFuture says how the save ended; a failure is also
        raised by the next save, save_async or load (once). One save is in
        flight at a time: the next call waits for it."""
        plan = _state.plan_save(state)
        return SaveFuture(self._core.save_async(int(step), plan.modules, plan.tensors,
                                                plan.metadata))

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

        got, _skipped = self._core.load(
            _state.module_request(state), step, _map_location(map_location), check)
        if got is not None:
            _state.apply(state, decoded)
        return got


class SaveFuture:
    """How a save_async ended (as concurrent.futures.Future, without
    callbacks). Ctrl-C ends a wait on it, not the save."""

    def __init__(self, core):
        self._core = core

    @property
    def step(self):
        return self._core.step

    def done(self):
        """True once the save ended (committed, or failed)."""
        return self._core.done()

    def result(self, timeout=None):
        """Waits until the save ended (at most ``timeout`` seconds; None or
        inf: no limit) and returns its step, or raises its error (rank 0's, on the
        waiting ranks too). TimeoutError if it is still running then."""
        if not self._core.wait(timeout):
            raise TimeoutError(f"the save of step {self.step} is still running after "
                               f"{timeout} s")
        self._core.raise_error()
        return self.step

    def exception(self, timeout=None):
        """The save's error, or None once it committed (waits as result)."""
        try:
            self.result(timeout)
        except Error as e:
            return e
        return None


def save(obj, uri):
    """``torch.save(obj, f)`` for a store: commits ``obj`` as the next step
    of the single-process store at ``uri`` (written, fsynced, checksummed,
    renamed into place; the newest steps of earlier saves stay). ``obj``: a
    value a state holds (tensors, and dicts, lists and tuples of tensors and
    plain values); a module, optimizer or any object with ``state_dict()``
    is saved as its ``state_dict()``, which ``load`` gives back. No pickle."""
    if _state.kind_of(obj) in ("module", "state_dict"):
        obj = obj.state_dict()
    plan = _state.plan_save({"value": obj})
    _ckptio.save_one(os.fspath(uri), plan.modules, plan.tensors, plan.metadata)


def load(uri, map_location=None, step=None):
    """``torch.load(f, map_location)`` for a store: the value saved by
    ``save`` in the newest step that verifies (a damaged newer step is
    skipped with a warning), or in ``step``; tensors go where
    ``map_location`` says (as in Checkpointer.load). Takes no lock: it may
    read while a job saves. NotFoundError when nothing is saved yet;
    DataLossError when no step verifies. A module comes back as its state
    dict: ``model.load_state_dict(ckptio.load(uri))``."""
    box = {"value": None}
    decoded = {}

    def check(metadata, tensors):
        decoded.update(_state.decode_step(box, metadata, tensors))

    _ckptio.load_one(os.fspath(uri), {}, step, _map_location(map_location), check)
    return decoded["value"]
