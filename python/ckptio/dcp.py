"""A storage plugin for ``torch.distributed.checkpoint`` (PyTorch >= 2.0).

    import torch.distributed.checkpoint as dcp
    import ckptio.dcp
    dcp.save(state_dict, storage_writer=ckptio.dcp.StorageWriter("/ckpt/run42"))
    dcp.load(state_dict, storage_reader=ckptio.dcp.StorageReader("/ckpt/run42"))

Each ``dcp.save`` is one step of a ckptio store (the next one, or ``step=``).
Every rank writes its own shards as one object of the step through ckptio's
atomic path (written, fsynced, checksummed); the coordinator adds each
rank's receipt, which exists only once that rank's object is durable, writes
DCP's metadata (as JSON: no pickle) and commits the step: its manifest last,
then LATEST. A save that any rank did not finish is never committed, and the
next save of that step clears what it left. ``dcp.load`` reads ``step=``, or
the newest step that verifies (the coordinator checks every byte of it, and
skips damaged steps, loudly); every rank verifies every byte it reads.

DCP itself (its default planners) still pickles non-tensor values of the
state dict (``torch.save`` into a byte item) and unpickles them on load:
ckptio stores those bytes verified, but what DCP does with them is DCP's.
"""
import dataclasses
import io
import json
import os

import torch

try:
    import torch.distributed.checkpoint as _dcp
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata,
                                                       ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
except ImportError as e:  # PyTorch 1.x
    raise ImportError(f"ckptio.dcp needs torch.distributed.checkpoint (PyTorch >= 2.0); this "
                      f"is PyTorch {torch.__version__} ({e})") from None

try:
    from torch.distributed.checkpoint.metadata import StorageMeta
except ImportError:  # PyTorch < 2.4
    StorageMeta = None

from . import _ckptio, _state
from ._errors import InvalidArgumentError

__all__ = ["StorageWriter", "StorageReader"]

METADATA_OBJECT = "dcp-metadata.json"
FORMAT = 1
_STEP_KEY = "ckptio.dcp"


def _object_of(index):
    """The object plan `index` writes (one per rank and save)."""
    return f"dcp-{index}.bin"


@dataclasses.dataclass(frozen=True)
class _Item:
    """Where a write item's bytes are: a range of one object of the step."""
    object: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class _PlanData:
    step: int
    index: int  # of the plan among the ranks' plans


def _dist():
    d = torch.distributed
    return d if d.is_available() and d.is_initialized() else None


# --- DCP's Metadata as JSON ------------------------------------------------

def _name(value):
    return str(value).split(".")[-1]  # torch.float32 -> "float32"


def _torch_attr(name, kind):
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise InvalidArgumentError(f"the step's {METADATA_OBJECT} names {name!r}, which is not a "
                                   f"torch.{kind.__name__}")
    return value


def _encode_metadata(md):
    state = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            state[fqn] = {"bytes": True}
            continue
        p = m.properties
        state[fqn] = {"dtype": _name(p.dtype), "layout": _name(p.layout),
                      "requires_grad": bool(p.requires_grad),
                      "memory_format": _name(p.memory_format), "pin_memory": bool(p.pin_memory),
                      "size": list(m.size),
                      "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    storage = [[i.fqn, None if i.offset is None else list(i.offset), i.index,
                d.object, d.offset, d.length] for i, d in (md.storage_data or {}).items()]
    tensors = {}
    planner = _state._encode(md.planner_data, "planner_data", (), tensors)
    if tensors:
        raise TypeError("DCP's planner_data holds tensors, which ckptio.dcp does not save")
    sm = getattr(md, "storage_meta", None)
    return json.dumps({"format": FORMAT, "state_dict_metadata": state, "storage_data": storage,
                       "planner_data": planner,
                       "storage_meta": None if sm is None else {
                           "checkpoint_id": None if sm.checkpoint_id is None
                           else os.fspath(sm.checkpoint_id),
                           "save_id": sm.save_id, "load_id": sm.load_id}},
                      separators=(",", ":"), allow_nan=False)


def _decode_metadata(text):
    try:
        j = json.loads(text)
        if j.get("format") != FORMAT:
            raise InvalidArgumentError(
                f"format {j.get('format')!r}; this ckptio reads format {FORMAT}: "
                "upgrade ckptio")
        state = {}
        for fqn, m in j["state_dict_metadata"].items():
            if m.get("bytes"):
                state[fqn] = BytesStorageMetadata()
                continue
            props = TensorProperties(
                dtype=_torch_attr(m["dtype"], torch.dtype),
                layout=_torch_attr(m["layout"], torch.layout),
                requires_grad=bool(m["requires_grad"]),
                memory_format=_torch_attr(m["memory_format"], torch.memory_format),
                pin_memory=bool(m["pin_memory"]))
            state[fqn] = TensorStorageMetadata(
                properties=props, size=torch.Size(m["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                        for o, s in m["chunks"]])
        storage = {MetadataIndex(fqn, offset, index): _Item(obj, int(off), int(length))
                   for fqn, offset, index, obj, off, length in j["storage_data"]}
        sm = j.get("storage_meta")
        kwargs = {}
        if sm is not None and StorageMeta is not None:
            kwargs["storage_meta"] = StorageMeta(**sm)
        return Metadata(state_dict_metadata=state,
                        planner_data=_state._decode(j["planner_data"], {}),
                        storage_data=storage, **kwargs)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        raise InvalidArgumentError(
            f"the step's {METADATA_OBJECT} does not hold DCP metadata ckptio can "
            f"read ({type(e).__name__}: {str(e)[:200]})") from None


# --- The plugin -------------------------------------------------------------

class StorageWriter(_dcp.StorageWriter):
    """Saves each ``dcp.save`` as a step of the ckptio store at ``uri`` (a
    path, ``file://`` or ``nfs://`` URI): ``step``, or the step after the
    newest one. ``keep_last`` steps are kept (0: all). The coordinator takes
    the store's writer lock for the save, waiting up to ``lock_wait``
    seconds for another writer. ``dcp.save(..., checkpoint_id=...)`` may
    name another store."""

    def __init__(self, uri, step=None, keep_last=0, lock_wait=60.0):
        super().__init__()
        self.uri = os.fspath(uri)
        self.step = step
        self.keep_last = int(keep_last)
        self.lock_wait = float(lock_wait)
        _ckptio.check_wait(self.lock_wait, "lock_wait")
        self._pending = None  # the coordinator's step, from its global plan to finish

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._abandon()

    def _abandon(self):
        if self._pending is not None:
            self._pending.abandon()
            self._pending = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator):
        pass  # (the coordinator is the writer that gets prepare_global_plan)

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        # The coordinator, before any rank writes: the writer lock, the step
        # begun (a torn earlier attempt at it cleared), each plan told the
        # step and its index.
        self._abandon()
        store = _ckptio.Store(self.uri)
        step = store.next_step() if self.step is None else int(self.step)
        dist = _dist()
        self._pending = store.begin(step, self.keep_last, self.lock_wait,
                                    dist.get_world_size() if dist else 1)
        return [dataclasses.replace(p, storage_data=_PlanData(step, i))
                for i, p in enumerate(plans)]

    def write_data(self, plan, planner):
        data = plan.storage_data
        results = []
        if plan.items:
            pieces = []
            for item in plan.items:
                value = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    pieces.append(value.getbuffer())
                else:
                    pieces.append(value.detach().cpu().contiguous().view(-1).view(torch.uint8)
                                  if value.numel() else torch.empty(0, dtype=torch.uint8))
            name = _object_of(data.index)
            if self._pending is not None:  # the coordinator writes into the step itself
                at = self._pending.write(name, pieces)
                receipt = None
            else:
                stripe = _ckptio.Store(self.uri).begin_stripe(data.step, data.index + 1)
                at = stripe.write(name, pieces)
                receipt = stripe.finish()  # the object is durable
            for n, (item, (offset, length)) in enumerate(zip(plan.items, at)):
                where = (_Receipted(name, offset, length, receipt) if n == 0 and receipt
                         else _Item(name, offset, length))
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=where))
        fut = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        # Every rank's write_data returned (DCP gathered their results): each
        # object is durable. The receipts, DCP's metadata, then the commit.
        pending, self._pending = self._pending, None
        if pending is None:
            raise InvalidArgumentError("finish() without prepare_global_plan() on this writer")
        try:
            storage = {}  # where each item's bytes are, for the readers
            for rank_results in results:
                for r in rank_results:
                    d = r.storage_data
                    if isinstance(d, _Receipted):
                        pending.add_stripe(d.receipt)
                    storage[r.index] = _Item(d.object, d.offset, d.length)
            metadata.storage_data = storage
            if StorageMeta is not None:
                metadata.storage_meta = self.storage_meta()
            pending.write(METADATA_OBJECT, [_encode_metadata(metadata).encode()])
            pending.set_metadata(_STEP_KEY, str(FORMAT))
            pending.commit()
        finally:
            pending.abandon()  # (after a commit: only the lock goes)

    def storage_meta(self):
        return None if StorageMeta is None else StorageMeta(checkpoint_id=self.uri)


@dataclasses.dataclass(frozen=True)
class _Receipted(_Item):
    """A rank's first item, carrying its stripe's receipt to the coordinator."""
    receipt: bytes = b""


class StorageReader(_dcp.StorageReader):
    """Loads a step of the ckptio store at ``uri``: ``step``, or the newest
    that verifies. With torch.distributed initialized, the coordinator of
    ``process_group`` (default: the default group) chooses the step and
    tells the other ranks, so that every rank reads the same one: without
    ``step``, read_metadata() is then a collective of ``process_group``
    (dcp.load calls it on every rank; a caller of its own, or
    dcp.load(no_dist=True), gives ``step``)."""

    def __init__(self, uri, step=None, process_group=None):
        super().__init__()
        self.uri = os.fspath(uri)
        self.step = step
        self.process_group = process_group
        self._reader = None
        self._metadata = None

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.uri = os.fspath(checkpoint_id)
        self._reader = self._metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, (str, os.PathLike))

    def _choose_step(self):
        if self.step is not None:
            return int(self.step)
        dist = _dist()
        group = self.process_group
        if dist is None or dist.get_world_size(group) == 1:
            return self._newest_good()
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        first = dist.get_global_rank(group, 0) if group is not None else 0
        box = torch.tensor([-1], dtype=torch.int64, device=device)
        error = None
        if dist.get_rank() == first:
            try:
                box[0] = self._newest_good()
            except Exception as e:  # noqa: BLE001 (sent on as "no step", raised here)
                error = e
        dist.broadcast(box, src=first, group=group)
        if error is not None:
            raise error
        if box.item() < 0:
            raise InvalidArgumentError(f"the coordinator found no step of {self.uri} to load "
                                       "(its error says why)")
        return int(box.item())

    def _newest_good(self):
        # (Reads and verifies every byte, keeping none: the chooser never
        # holds the step in memory, however large the sharded state.)
        return _ckptio.Store(self.uri).newest_good()

    def read_metadata(self):
        step = self._choose_step()
        self._reader = _ckptio.Store(self.uri).open_step(step)
        if _STEP_KEY not in self._reader.metadata:
            raise InvalidArgumentError(
                f"step {step} of {self.uri} was not saved by "
                "torch.distributed.checkpoint (ckptio.dcp): load it "
                "with ckptio.Checkpointer")
        return _decode_metadata(self._reader.read_all(METADATA_OBJECT).decode())

    def set_up_storage_reader(self, metadata, is_coordinator):
        self._metadata = metadata

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        md = self._metadata
        for req in plan.items:
            where = md.storage_data[req.storage_index]
            raw = self._reader.read(where.object, where.offset, where.length)  # verified
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
                continue
            tmd = md.state_dict_metadata[req.storage_index.fqn]
            chunk = next(c for c in tmd.chunks if c.offsets == req.storage_index.offset)
            saved = raw.view(tmd.properties.dtype).reshape(chunk.sizes)
            for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                saved = saved.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != saved.size():
                raise InvalidArgumentError(
                    f"{req.storage_index.fqn}: the step holds {list(saved.size())}, "
                    f"the state {list(target.size())}")
            target.copy_(saved)
            planner.commit_tensor(req, target)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut
