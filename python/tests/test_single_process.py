"""The Python package in one process: every value kind round trips bit for
bit, loads are all or nothing, errors are typed, and nothing is pickled."""
import json
import math
import os
import subprocess

import pytest
import torch

import ckptio


def bit_equal(a, b):
    """Same dtype, shape and device, and the same bytes (nan == nan)."""
    def raw(t):
        t = t.detach().contiguous().reshape(-1)
        return t if t.dtype == torch.bool else t.view(torch.uint8)
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
            and torch.equal(raw(a), raw(b)))


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train_a_little(model, optim, steps=3):
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(5, 8)).sum().backward()
        optim.step()


@pytest.fixture
def store(tmp_path):
    return str(tmp_path / "store")


def test_a_fresh_store_loads_nothing_and_changes_nothing(store):
    model = make_model(0)
    before = [p.clone() for p in model.parameters()]
    state = {"model": model, "epoch": 7}
    assert ckptio.Checkpointer(store).load(state) is None
    assert state["epoch"] == 7
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_module_optimizer_scheduler_and_values_round_trip(store):
    model = make_model(1)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    train_a_little(model, optim)
    sched.step()
    values = {"i": -(2 ** 62), "f": 0.1, "inf": math.inf, "ninf": -math.inf, "nan": math.nan,
              "s": "ünïcode\n\"q\"", "b": b"\x00\xffbytes", "t": True, "none": None,
              "list": [1, 2.5, "x", [torch.arange(3)]], "tuple": (1, (2, 3)),
              "dict": {1: "int key", "k": {"deep": torch.ones(2, 2, dtype=torch.float16)}}}
    state = {"model": model, "optim": optim, "sched": sched, "epoch": 3,
             "rng": torch.get_rng_state(), "values": values}
    ckpt = ckptio.Checkpointer(store, keep_last=2)
    ckpt.save(3, state)

    model2 = make_model(2)
    optim2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=2, gamma=0.5)
    state2 = {"model": model2, "optim": optim2, "sched": sched2, "epoch": 0,
              "rng": torch.zeros(1), "values": None}
    assert ckpt.load(state2) == 3
    for (n1, a), (n2, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and bit_equal(a, b), n1
    assert state2["epoch"] == 3
    assert bit_equal(state2["rng"], state["rng"])
    assert sched2.state_dict() == sched.state_dict()
    s1, s2 = optim.state_dict(), optim2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for name, v in s1["state"][k].items():
            w = s2["state"][k][name]
            assert bit_equal(v, w) if torch.is_tensor(v) else v == w, (k, name)
    got = state2["values"]
    assert got["i"] == values["i"] and got["s"] == values["s"] and got["b"] == values["b"]
    assert got["f"] == 0.1 and got["inf"] == math.inf and got["ninf"] == -math.inf
    assert math.isnan(got["nan"]) and got["t"] is True and got["none"] is None
    assert got["tuple"] == (1, (2, 3)) and got["dict"][1] == "int key"
    assert bit_equal(got["list"][3][0], torch.arange(3))
    assert bit_equal(got["dict"]["k"]["deep"], values["dict"]["k"]["deep"])
    # The training goes on identically from either.
    torch.manual_seed(9)
    train_a_little(model, optim)
    torch.manual_seed(9)
    train_a_little(model2, optim2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert bit_equal(a, b)


def test_a_module_is_filled_in_place(store):
    model = make_model(3)
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(1, {"model": model})
    model2 = make_model(4)
    memory = [p.data_ptr() for p in model2.parameters()]
    ckpt.load({"model": model2})
    assert memory == [p.data_ptr() for p in model2.parameters()]
    assert all(bit_equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_what_cannot_be_saved_is_a_type_error_naming_its_path_before_anything_is_written(store):
    ckpt = ckptio.Checkpointer(store)

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"state\['cfg'\]\['layers'\]\[1\].*Opaque"):
        ckpt.save(1, {"cfg": {"layers": [1, Opaque()]}})
    with pytest.raises(TypeError, match="dict key"):
        ckpt.save(1, {"cfg": {(1, 2): 3}})
    for key in ("../up", "w\n", ".hidden", "tensors", "x" * 161, 7):
        with pytest.raises(ckptio.InvalidArgumentError, match="state key"):
            ckpt.save(1, {key: 1})
    assert ckpt.load({"x": 0}) is None  # nothing was written


def test_the_binding_refuses_a_tensors_dict_that_does_not_map_names_to_tensors(store):
    # (The Python layer never passes one; the binding, which reads the
    # tensors inside the dict's objects, checks anyway.)
    from ckptio import _ckptio
    for bad in ({"a": 1}, {"a": [torch.ones(1)]}, {7: torch.ones(1)}):
        with pytest.raises(TypeError, match="tensors must map str names to tensors"):
            _ckptio.save_one(store, {}, bad, {})
    assert ckptio.Checkpointer(store).load({"a": None}) is None  # nothing was written


def test_a_load_that_does_not_fit_raises_and_changes_nothing(store):
    model = make_model(5)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(1, {"model": model, "optim": optim})

    model2 = make_model(6)
    before = [p.clone() for p in model2.parameters()]
    other = torch.optim.SGD([{"params": list(model2.parameters())[:2]},
                             {"params": list(model2.parameters())[2:]}], lr=0.1)
    with pytest.raises(ckptio.InvalidArgumentError, match="parameter groups"):
        ckpt.load({"model": model2, "optim": other})
    assert all(torch.equal(a, b) for a, b in zip(before, model2.parameters()))

    with pytest.raises(ckptio.InvalidArgumentError, match="is this the same model"):
        ckpt.load({"model": torch.nn.Linear(8, 3)})
    wider = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 5))
    with pytest.raises(ckptio.InvalidArgumentError, match=r"shape \[4, 16\] in the checkpoint"):
        ckpt.load({"model": wider})
    with pytest.raises(ckptio.InvalidArgumentError, match="holds no item 'missing'"):
        ckpt.load({"model": model2, "missing": 1})


def test_top_level_tensors_are_items_of_their_own(store):
    # They are the step's named tensors, without an entry in the step's tree
    # (so 10,000 of them cost no JSON), and load as any other item.
    ckpt = ckptio.Checkpointer(store)
    w, b = torch.randn(3, 4), torch.arange(5)
    ckpt.save(1, {"w": w, "b": b, "epoch": 3, "nested": {"t": w}})
    with open(os.path.join(store, "step-000000000001", "MANIFEST.json")) as f:
        items = json.loads(json.load(f)["metadata"]["user.ckptio.python"])["items"]
    assert sorted(items) == ["epoch", "nested"]
    state = {"w": None, "b": None, "epoch": 0, "nested": None}
    assert ckpt.load(state) == 1
    assert torch.equal(state["w"], w) and torch.equal(state["b"], b) and state["epoch"] == 3
    assert torch.equal(state["nested"]["t"], w)
    with pytest.raises(ckptio.InvalidArgumentError,
                       match=r"holds no item 'x' \(it holds \['b', 'epoch', 'nested', 'w'\]\)"):
        ckpt.load({"w": None, "x": None})
    # An object with state_dict() is not replaced by a tensor; nothing changes.
    optim = torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1)
    state = {"w": optim, "epoch": 0}
    with pytest.raises(ckptio.InvalidArgumentError,
                       match="has state_dict.., but the step saved a tensor under 'w'"):
        ckpt.load(state)
    assert state["w"] is optim and state["epoch"] == 0


def test_a_load_pauses_the_cycle_collector_and_leaves_it_as_it_was(store):
    # Off while the load makes its objects (collections there walk every
    # live object); back as it was afterwards, also after a failed load.
    import gc
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(1, {"w": torch.ones(2), "epoch": 3})
    ckptio.save({"t": torch.ones(2)}, os.path.join(store, "one"))
    seen = []
    real_decode = ckptio._state.decode_step

    def decode(*args):
        seen.append(gc.isenabled())
        return real_decode(*args)

    ckptio._state.decode_step = decode
    try:
        for enabled in (True, False):
            gc.enable() if enabled else gc.disable()
            seen.clear()
            assert ckpt.load({"w": None, "epoch": 0}) == 1
            assert ckptio.load(os.path.join(store, "one"))["t"].sum() == 2
            with pytest.raises(ckptio.InvalidArgumentError, match="holds no item 'x'"):
                ckpt.load({"x": None})
            assert seen == [False, False, False], seen
            assert gc.isenabled() == enabled
    finally:
        ckptio._state.decode_step = real_decode
        gc.enable()


def test_a_corrupt_newest_step_is_skipped_for_the_previous_one(store, capfd):
    model = make_model(7)
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(1, {"model": model, "epoch": 1})
    ckpt.save(2, {"model": model, "epoch": 2})
    victim = os.path.join(store, "step-000000000002", "model.safetensors")
    with open(victim, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    state = {"model": make_model(8), "epoch": 0}
    assert ckpt.load(state) == 1
    assert state["epoch"] == 1
    assert "step 2 failed verification" in capfd.readouterr().err
    with pytest.raises(ckptio.DataLossError):
        ckpt.load(state, step=2)


class WithExtraState(torch.nn.Linear):
    def get_extra_state(self):
        return {"calls": 3}

    def set_extra_state(self, state):
        pass


def test_a_modules_extra_state_is_a_type_error_naming_it(store):
    ckpt = ckptio.Checkpointer(store)
    with pytest.raises(TypeError, match=r"state\['m'\]\['_extra_state'\] is a builtins.dict"):
        ckpt.save(1, {"m": WithExtraState(2, 2)})
    ckpt.save(1, {"m": torch.nn.Linear(2, 2)})
    with pytest.raises(TypeError, match="get_extra_state"):
        ckpt.load({"m": WithExtraState(2, 2)})


def test_map_location_forms(store):
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(1, {"t": torch.arange(4.0)})
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda saved: "cpu",
                  lambda storage, loc: storage if loc == "x" else "cpu",
                  # torch.load's idioms for "on the CPU", and None for "as saved"
                  lambda storage, loc: storage, lambda storage, loc: storage.cpu(),
                  lambda storage, loc: storage.to("cpu"), lambda storage, loc: None):
        state = {"t": None}
        assert ckpt.load(state, map_location=where) == 1
        assert bit_equal(state["t"], torch.arange(4.0))

    def boom(saved):
        raise KeyError(f"no rule for {saved}")

    with pytest.raises(KeyError, match="no rule for cpu"):
        ckpt.load({"t": None}, map_location=boom)
    if not torch.cuda.is_available():
        with pytest.raises(ckptio.FailedPreconditionError, match="cuda"):
            ckpt.load({"t": None}, map_location="cuda:0")
        with pytest.raises(ckptio.FailedPreconditionError, match="cuda:1"):
            ckpt.load({"t": None}, map_location=lambda storage, loc: storage.cuda(1))


def test_nothing_is_pickled_and_the_cxx_tools_read_python_steps(store):
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(5, {"model": make_model(9), "epoch": 5, "note": "hi"})
    step_dir = os.path.join(store, "step-000000000005")
    manifest = json.load(open(os.path.join(step_dir, "MANIFEST.json")))
    objects = sorted(o["name"] for o in manifest["objects"])
    assert objects == ["model.safetensors"], objects
    meta = manifest["metadata"]
    assert meta["user.epoch"] == "5" and meta["user.note"] == "hi"
    assert meta["ckptio.item.model"] == "module"
    cli = os.path.join(os.environ.get("CKPTIO_BIN", "build/bin"), "ckptio")
    if not os.path.exists(cli):
        pytest.skip(f"no ckptio CLI at {cli} (set CKPTIO_BIN)")
    out = subprocess.run([cli, "verify", store, "5"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_errors_are_typed():
    assert issubclass(ckptio.DeadlineExceededError, TimeoutError)
    assert issubclass(ckptio.InvalidArgumentError, ValueError)
    assert issubclass(ckptio.WriterDiedError, ckptio.Error)
    with pytest.raises(ckptio.InvalidArgumentError, match="wait="):
        ckptio.Checkpointer("/tmp/x", wait="sometimes")
    with pytest.raises(ckptio.InvalidArgumentError):
        ckptio.Checkpointer("nosuch://x")


def test_threads_sharing_one_step_reader_each_get_their_own_verified_bytes(store):
    # The low-level reader (ckptio.dcp reads through it) releases the GIL
    # while it reads and verifies: threads sharing it must still each get
    # exactly their bytes. Reads cut chunks, so they go through the reader's
    # scratch buffer, the state that threads would share.
    import random
    import threading
    from ckptio import _ckptio
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(1, {"t": torch.arange(3 << 20, dtype=torch.int32)})  # 12 MiB: 3 chunks
    reader = _ckptio.Store(store).open_step(1)
    whole = reader.read_all("tensors.safetensors")
    failures = []

    def reads(seed):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                off = rng.randrange(len(whole) - 4096)
                size = rng.randrange(1, min(len(whole) - off, 6 << 20))
                got = bytes(reader.read("tensors.safetensors", off, size).numpy())
                if got != whole[off:off + size]:
                    failures.append(f"bytes [{off}, {off + size}) differ")
                    return
        except Exception as e:  # a mismatch the reader reported is a failure too
            failures.append(repr(e))

    threads = [threading.Thread(target=reads, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_a_read_outside_an_object_is_refused_before_anything_is_allocated(store):
    # A size no machine could allocate (2**62 bytes): the range check answers,
    # naming the store and step, not the allocator (nor torch's negative
    # dimension for a size of 2**63 and above).
    from ckptio import _ckptio
    ckptio.Checkpointer(store).save(1, {"t": torch.arange(10)})
    reader = _ckptio.Store(store).open_step(1)
    for offset, size in [(0, 1 << 62), (0, 1 << 63), (1 << 63, 1), (1, (1 << 64) - 1)]:
        with pytest.raises(ckptio.InvalidArgumentError, match="step 1: read of bytes"):
            reader.read("tensors.safetensors", offset, size)
    with pytest.raises(ckptio.NotFoundError):
        reader.read("no-such-object", 0, 1 << 62)
