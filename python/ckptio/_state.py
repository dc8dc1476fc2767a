"""A trainer's state in a step, and back: no pickle, ever.

A state is a dict of top-level items:
  - a ``torch.nn.Module``: saved as a module object "<key>.safetensors" (its
    parameters and buffers by name, exactly as the C++ Checkpointer saves a
    ``torch::nn::Module``) and loaded in place, strictly;
  - a tensor: the step's named tensor "<key>" (a C++ ``State`` tensor item);
  - anything with ``state_dict()`` / ``load_state_dict()`` (optimizers,
    schedulers, GradScaler): its state dict, encoded as a value;
  - a value: None, bool, int, float (inf and nan too), str, bytes, tensors,
    and dicts, lists and tuples of these.

Values are encoded as JSON with tags, kept in the step's metadata under
``ckptio.python``; every tensor inside goes to the step's named tensors as
"<key>/<path>" and the JSON names it. Top-level tensors have no entry there
(10,000 of them would cost milliseconds of JSON for nothing): a named tensor
without "/" is one, as in steps from C++. Top-level ints and strs are also
plain metadata entries, which the C++ ``State::GetInt`` reads.
"""
import base64
import json
import re

import torch

from ._errors import InvalidArgumentError

TREE_KEY = "ckptio.python"
FORMAT = 1
_ITEM_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,159}")  # (fullmatch)


# The item of a top-level tensor, which has no entry in the tree (steps
# saved before that change list it; steps from C++ have no tree).
_TENSOR_ITEM = {"kind": "tensor"}


def _path_str(path):
    return "".join(f"[{p!r}]" for p in path)


class Plan:
    """What a save writes: module tensors, named tensors and metadata."""

    def __init__(self):
        self.modules = {}   # key -> [(name, tensor)]
        self.tensors = {}   # tensor name -> tensor
        self.metadata = {}  # str -> str


def _encode(value, key, path, tensors):
    """`value` as tagged JSON; its tensors added to `tensors`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return {"$f": value.hex()}  # exact, and inf / nan
    if isinstance(value, (bytes, bytearray)):
        return {"$b": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.Tensor):
        name = key + "/" + "/".join(str(p) for p in path) if path else key
        if name in tensors:
            raise InvalidArgumentError(
                f"state[{key!r}]{_path_str(path)}: two tensors would be named "
                f"{name!r}; rename a key")
        tensors[name] = value
        return {"$t": name}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, key, path + (i,), tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, key, path + (i,), tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise TypeError(f"state[{key!r}]{_path_str(path)}: dict key {k!r} of type "
                                f"{type(k).__name__} cannot be saved (keys: str, int, float, "
                                "bool, None)")
            items.append([_encode(k, key, path, {}), _encode(v, key, path + (k,), tensors)])
        return {"$d": items}
    raise TypeError(f"state[{key!r}]{_path_str(path)} is a {type(value).__module__}."
                    f"{type(value).__qualname__}, which ckptio does not save (no pickle): "
                    "save tensors, modules, objects with state_dict(), or None, bool, int, "
                    "float, str, bytes and dicts, lists and tuples of them")


def _decode(enc, tensors):
    if enc is None or isinstance(enc, (bool, int, str)):
        return enc
    if isinstance(enc, list):
        return [_decode(v, tensors) for v in enc]
    if isinstance(enc, dict) and len(enc) == 1:
        (tag, body), = enc.items()
        if tag == "$f":
            return float.fromhex(body)
        if tag == "$b":
            return base64.b64decode(body)
        if tag == "$t":
            if body not in tensors:
                raise InvalidArgumentError(f"the step names tensor {body!r} but does not hold it")
            return tensors[body]
        if tag == "$tuple":
            return tuple(_decode(v, tensors) for v in body)
        if tag == "$d":
            return {_decode(k, tensors): _decode(v, tensors) for k, v in body}
    raise InvalidArgumentError(f"the step's {TREE_KEY} holds an unknown value {str(enc)[:80]!r}")


_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_PLAIN = frozenset((type(None), bool, int, float, str, bytes, list, tuple, dict))


def kind_of(value):
    # (Tensors and plain values by their exact type first: a state of 10,000
    # of them is asked on every save and twice a load, and the checks below
    # cost microseconds each.)
    t = type(value)
    if t in _TENSORS:
        return "tensor"
    if t in _PLAIN:
        return "value"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)):
        return "state_dict"
    return "value"


def check_keys(state):
    if not isinstance(state, dict):
        raise TypeError(f"the state must be a dict of named items, not a {type(state).__name__}")
    name = _ITEM_NAME.fullmatch
    for key in state:
        if not isinstance(key, str) or not name(key) or key == "tensors":
            raise InvalidArgumentError(
                f"state key {key!r}: keys are 1 to 160 of [A-Za-z0-9._-], not "
                "starting with '.', and not \"tensors\"")


def _module_tensors(key, module):
    """A module's state_dict() as [(name, tensor)]; TypeError naming the
    entry that is not a tensor (a get_extra_state() result)."""
    entries = list(module.state_dict(keep_vars=True).items())
    for name, value in entries:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state[{key!r}][{name!r}] is a {type(value).__module__}."
                f"{type(value).__qualname__}, not a tensor (the module's get_extra_state()?): "
                "ckptio saves and fills a module's tensors only; keep that state as a value "
                "of its own in the state dict")
    return entries


def plan_save(state):
    """The Plan of `state`; TypeError / InvalidArgumentError naming the key path of
    anything that cannot be saved, before anything is written."""
    check_keys(state)
    plan = Plan()
    items = {}
    for key, value in state.items():
        kind = kind_of(value)
        if kind == "module":
            plan.modules[key] = _module_tensors(key, value)
        elif kind == "tensor":
            plan.tensors[key] = value
            continue  # no entry: the named tensor "<key>" is the item
        elif kind == "state_dict":
            items[key] = {"kind": kind, "value": _encode(value.state_dict(), key, (), plan.tensors)}
            continue
        else:
            items[key] = {"kind": kind, "value": _encode(value, key, (), plan.tensors)}
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                plan.metadata[key] = str(value)  # also for C++ readers (State::GetInt)
            continue
        items[key] = {"kind": kind}
    plan.metadata[TREE_KEY] = json.dumps({"format": FORMAT, "items": items},
                                         separators=(",", ":"), allow_nan=False)
    return plan


def module_request(state):
    """The modules a load fills in place: key -> [(name, tensor)]."""
    check_keys(state)
    return {k: _module_tensors(k, v) for k, v in state.items() if kind_of(v) == "module"}


def _check_optimizer(key, optimizer, loaded):
    """What torch.optim.Optimizer.load_state_dict would refuse, checked
    before anything is loaded."""
    groups, saved = optimizer.param_groups, loaded.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(groups):
        raise InvalidArgumentError(
            f"state[{key!r}]: the optimizer has {len(groups)} parameter groups, "
            f"the step {len(saved) if isinstance(saved, list) else 'none'}")
    for i, (g, s) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(s.get("params", ())):
            raise InvalidArgumentError(
                f"state[{key!r}]: parameter group {i} has {len(g['params'])} "
                f"parameters, the step's {len(s.get('params', ()))}")


class LoadStateDict:
    """A decoded state dict, for its item's load_state_dict (a plain value
    is assigned: no wrapper for each of 10,000 tensors)."""
    __slots__ = ("state_dict",)

    def __init__(self, state_dict):
        self.state_dict = state_dict


def decode_step(state, metadata, tensors):
    """What a load puts into `state`: key -> its new value, or a
    LoadStateDict for an item's load_state_dict; raises InvalidArgumentError, before
    anything changes, when the step does not fit, or its tree is not one
    ckptio writes (whatever it holds)."""
    try:
        return _decode_step(state, metadata, tensors)
    except (KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        raise InvalidArgumentError(
            f"the step's {TREE_KEY} is malformed ({type(e).__name__}: "
            f"{str(e)[:200]}): ckptio did not write it, or wrote it damaged") from None


def _decode_step(state, metadata, tensors):
    tree = metadata.get(TREE_KEY)
    if tree is None:  # saved by the C++ Checkpointer: modules, tensors, metadata
        items = {k: {"kind": "cxx_metadata"} for k, v in state.items()
                 if kind_of(v) == "value" and k in metadata and k not in tensors}
    else:
        try:
            tree = json.loads(tree)
        except ValueError as e:
            raise InvalidArgumentError(f"the step's {TREE_KEY} is not JSON: {e}") from None
        if not isinstance(tree, dict) or tree.get("format") != FORMAT:
            raise InvalidArgumentError(
                f"the step's {TREE_KEY} has format {tree.get('format')!r}; this "
                f"ckptio reads format {FORMAT}: upgrade ckptio")
        items = tree["items"]
    out = {}
    for key, value in state.items():
        kind = kind_of(value)
        if kind == "module":
            continue  # loaded in place by the core
        entry = items.get(key)
        if entry is None and key in tensors:  # a top-level tensor (keys hold no "/")
            entry = _TENSOR_ITEM
        if entry is None:
            held = sorted(set(items) | {k for k in tensors if "/" not in k})
            raise InvalidArgumentError(f"state[{key!r}]: the step holds no item {key!r} (it holds "
                                       f"{held[:20]})")
        if entry["kind"] == "tensor":
            if kind == "state_dict":
                raise InvalidArgumentError(f"state[{key!r}] has state_dict(), but the step saved a "
                                           f"tensor under {key!r}")
            if key not in tensors:
                raise InvalidArgumentError(
                    f"state[{key!r}]: the step lists tensor {key!r} but does not "
                    "hold it")
            out[key] = tensors[key]
        elif entry["kind"] == "cxx_metadata":
            raw = metadata[key]
            as_int = isinstance(value, int) and re.fullmatch(r"-?[0-9]+", raw)
            out[key] = int(raw) if as_int else raw
        elif kind == "state_dict":
            if entry["kind"] != "state_dict":
                raise InvalidArgumentError(f"state[{key!r}] has state_dict(), but the step saved a "
                                           f"{entry['kind']} under {key!r}")
            decoded = _decode(entry["value"], tensors)
            if isinstance(value, torch.optim.Optimizer):
                _check_optimizer(key, value, decoded)
            out[key] = LoadStateDict(decoded)
        else:
            if entry["kind"] != "value":
                raise InvalidArgumentError(
                    f"state[{key!r}]: the step saved a {entry['kind']} under "
                    f"{key!r}, not a value")
            out[key] = _decode(entry["value"], tensors)
    return out


def apply(state, decoded):
    for key, value in decoded.items():
        if type(value) is LoadStateDict:
            state[key].load_state_dict(value.state_dict)
        else:
            state[key] = value
