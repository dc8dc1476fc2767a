"""A store someone else wrote: committed, verifying steps whose Python tree
(the ckptio.python metadata entry) is not one ckptio writes. Every such
load is an InvalidArgumentError (a ValueError) naming the entry, raised
before the state changes, and nothing in the store is ever executed: there
is no pickle to run."""
import json
import os

import pytest
import torch

import ckptio

PWNED = "ckptio-hostile-store-pwned"


def commit(store, step, tree, tensors=None):
    """Commits a step holding `tree` as its ckptio.python entry, through the
    core (so it is committed and verifies like any step)."""
    ckpt = ckptio.Checkpointer(store)
    text = tree if isinstance(tree, str) else json.dumps(tree)
    ckpt._core.save(step, {}, tensors or {}, {"ckptio.python": text})


def items(entries):
    return {"format": 1, "items": entries}


HOSTILE = {
    "not JSON": "{\"format\": 1, \"items\": ",
    "not an object": "[1, 2, 3]",
    "a newer format": {"format": 99, "items": {}},
    "items not a dict": {"format": 1, "items": [1]},
    "an entry without a kind": items({"epoch": {"value": 1}}),
    "an unknown tag": items({"epoch": {"kind": "value", "value": {"$x": 1}}}),
    "a pickle-looking tag": items({"epoch": {"kind": "value",
                                             "value": {"$pickle": "Y29zCnN5c3RlbQ=="}}}),
    "a tensor it does not hold": items({"epoch": {"kind": "value", "value": {"$t": "nope"}}}),
    "a bad float": items({"epoch": {"kind": "value", "value": {"$f": "not hex"}}}),
    "bad base64": items({"epoch": {"kind": "value", "value": {"$b": "***"}}}),
    "a dict body that is not pairs": items({"epoch": {"kind": "value", "value": {"$d": [1]}}}),
    "a tuple body that is not a list": items({"epoch": {"kind": "value",
                                                        "value": {"$tuple": 5}}}),
    "deep nesting": '{"format": 1, "items": {"epoch": {"kind": "value", "value": '
                    + "[" * 100000 + "]" * 100000 + "}}}",
    "a module where a value is": items({"epoch": {"kind": "module"}}),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_tree_is_an_invalid_argument_error_and_changes_nothing(tmp_path, name):
    store = str(tmp_path / "store")
    commit(store, 1, HOSTILE[name])
    model = torch.nn.Linear(3, 3)
    before = model.weight.clone()
    state = {"model": model, "epoch": 7}
    with pytest.raises(ckptio.InvalidArgumentError):
        ckptio.Checkpointer(store).load(state)
    assert state["epoch"] == 7 and torch.equal(model.weight, before)
    assert not os.path.exists(tmp_path / PWNED)


def test_a_tree_can_name_only_tensors_of_its_own_step(tmp_path):
    store = str(tmp_path / "store")
    commit(store, 1, items({"x": {"kind": "value", "value": {"$t": "x/0"}}}),
           {"x/0": torch.arange(4)})
    state = {"x": None}
    assert ckptio.Checkpointer(store).load(state) == 1
    assert torch.equal(state["x"], torch.arange(4))


def test_bytes_that_look_like_a_pickle_stay_bytes(tmp_path):
    # A pickle that would create a file if anything unpickled it.
    payload = (b"cos\nsystem\n(S'touch " + str(tmp_path / PWNED).encode() + b"'\ntR.")
    uri = str(tmp_path / "one")
    ckptio.save({"blob": payload}, uri)
    assert ckptio.load(uri)["blob"] == payload
    assert not os.path.exists(tmp_path / PWNED)


def saved_store(tmp_path, steps=(1, 2)):
    store = str(tmp_path / "store")
    ckpt = ckptio.Checkpointer(store)
    for s in steps:
        ckpt.save(s, {"w": torch.full((1000,), float(s)), "epoch": s})
    del ckpt
    return store


def step_dir(store, step):
    return os.path.join(store, f"step-{step:012d}")


def test_garbage_truncation_and_links_out_of_the_store_never_load(tmp_path, capfd):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"\x00" * 8192)
    state = {"w": None, "epoch": 0}
    damage = {
        "a garbage manifest": lambda d: open(os.path.join(d, "MANIFEST.json"), "wb").write(
            os.urandom(300)),
        "a truncated object": lambda d: os.truncate(
            os.path.join(d, "tensors.safetensors"), 100),
    }
    for what, hurt in damage.items():
        base = tmp_path / what.replace(" ", "-")
        base.mkdir()
        fresh = saved_store(base)
        hurt(step_dir(fresh, 2))
        got = dict(state)
        assert ckptio.Checkpointer(fresh).load(got) == 1, what  # step 2 skipped, loudly
        assert got["epoch"] == 1 and torch.equal(got["w"], torch.full((1000,), 1.0)), what
        assert "step 2" in capfd.readouterr().err, what
        with pytest.raises(ckptio.DataLossError):
            ckptio.Checkpointer(fresh).load(dict(state), step=2)
    # A link is not damage to skip past but a store ckptio will not read:
    # the load stops, saying so, and nothing outside is read or written.
    base = tmp_path / "linked"
    base.mkdir()
    linked = saved_store(base)
    victim = os.path.join(step_dir(linked, 2), "tensors.safetensors")
    os.remove(victim)
    os.symlink(outside / "secret", victim)
    with pytest.raises(ckptio.FailedPreconditionError, match="never follows links"):
        ckptio.Checkpointer(linked).load(dict(state))
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_bytes() == b"\x00" * 8192


def test_a_store_whose_every_step_is_damaged_raises_instead_of_starting_over(tmp_path):
    store = saved_store(tmp_path)
    for s in (1, 2):
        os.truncate(os.path.join(step_dir(store, s), "tensors.safetensors"), 10)
    state = {"w": torch.zeros(1000), "epoch": 0}
    with pytest.raises(ckptio.DataLossError, match="no checkpoint in .* verifies"):
        ckptio.Checkpointer(store).load(state)
    assert state["epoch"] == 0
    with pytest.raises(ckptio.DataLossError):
        ckptio.load(store)


def test_traversal_in_names_is_refused_before_anything_is_written(tmp_path):
    store = tmp_path / "store"
    for bad in ("../escape", "a/../../b", "/abs", ".hidden"):
        with pytest.raises(ckptio.InvalidArgumentError):
            ckptio.Checkpointer(str(store)).save(1, {bad: torch.ones(1)})
    assert not (tmp_path / "escape").exists() and not (tmp_path / "b").exists()
    assert not os.path.exists(os.path.join(str(store), "step-000000000001"))
