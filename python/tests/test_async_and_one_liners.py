"""save_async (the state may change as soon as it returns; the future and
the next call report a failure) and the one-liners ckptio.save / ckptio.load
(next step, newest good step, no lock, values only)."""
import math
import os

import pytest
import torch

import ckptio


def model_of(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def corrupt(path):
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")


def test_save_async_saves_the_state_as_it_was_when_the_call_returned(tmp_path):
    ckpt = ckptio.Checkpointer(tmp_path / "store")
    model = model_of(0)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_avg = optim.state_dict()["state"][0]["exp_avg"].clone()
    fut = ckpt.save_async(5, {"model": model, "optim": optim, "epoch": 5})
    with torch.no_grad():  # training goes on at once
        for p in model.parameters():
            p.add_(1.0)
        optim.state_dict()["state"][0]["exp_avg"].add_(1.0)
    assert fut.step == 5
    assert fut.result(timeout=60) == 5 and fut.done() and fut.exception() is None

    loaded, loaded_optim = model_of(1), None
    loaded_optim = torch.optim.Adam(loaded.parameters())
    state = {"model": loaded, "optim": loaded_optim, "epoch": 0}
    assert ckpt.load(state) == 5
    assert state["epoch"] == 5
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert torch.equal(loaded_optim.state_dict()["state"][0]["exp_avg"], saved_avg)


def test_timeouts_are_checked_and_a_future_waits_as_concurrent_futures_does(tmp_path):
    # Infinite, huge or negative seconds overflowed milliseconds before.
    for bad in (math.inf, math.nan, -1.0, 1e16):
        with pytest.raises(ckptio.InvalidArgumentError, match="timeout="):
            ckptio.Checkpointer(tmp_path / "store", timeout=bad)
    ckpt = ckptio.Checkpointer(tmp_path / "store")
    fut = ckpt.save_async(1, {"w": torch.ones(3)})
    with pytest.raises(ckptio.InvalidArgumentError, match="timeout=nan"):
        fut.result(timeout=math.nan)
    assert fut.result(timeout=math.inf) == 1  # no limit, as None
    assert fut.result(timeout=1e16) == 1
    assert fut.result(timeout=-1) == 1  # done: no time needed


def test_a_failed_save_async_is_on_its_future_and_raised_by_the_next_call_once(tmp_path):
    ckpt = ckptio.Checkpointer(tmp_path / "store")
    state = {"w": torch.ones(3)}
    ckpt.save(1, state)
    fut = ckpt.save_async(1, state)  # step 1 is committed: this save fails
    err = fut.exception(timeout=60)
    assert isinstance(err, ckptio.AlreadyExistsError), err
    with pytest.raises(ckptio.AlreadyExistsError):
        fut.result()
    with pytest.raises(ckptio.AlreadyExistsError, match="asynchronous save of step 1 failed"):
        ckpt.save(2, state)
    ckpt.save(2, state)  # reported once; the store goes on
    assert ckpt.load({"w": torch.zeros(3)}) == 2


def test_save_async_refuses_what_cannot_be_saved_before_anything_starts(tmp_path):
    ckpt = ckptio.Checkpointer(tmp_path / "store")
    with pytest.raises(TypeError, match=r"state\['cfg'\]\['f'\]"):
        ckpt.save_async(1, {"cfg": {"f": object()}})
    assert ckpt.load({"cfg": None}) is None


def test_one_liners_save_the_next_step_and_load_the_newest_good_one(tmp_path, capfd):
    uri = str(tmp_path / "one")
    with pytest.raises(ckptio.NotFoundError, match="nothing saved"):
        ckptio.load(uri)
    t = torch.arange(10, dtype=torch.float64)
    ckptio.save(t, uri)
    got = ckptio.load(uri, map_location="cpu")
    assert torch.equal(got, t) and got.dtype == torch.float64
    value = {"step": 3, "weights": [torch.ones(2), torch.zeros(1)], "name": "run"}
    ckptio.save(value, uri)
    assert sorted(os.listdir(uri)).count("step-000000000001") == 1
    got = ckptio.load(uri)
    assert got["step"] == 3 and got["name"] == "run"
    assert torch.equal(got["weights"][0], torch.ones(2))
    assert torch.equal(ckptio.load(uri, step=0), t)

    corrupt(os.path.join(uri, "step-000000000001", "tensors.safetensors"))
    assert torch.equal(ckptio.load(uri), t)  # the damaged newest step is skipped
    assert "step 1 failed verification" in capfd.readouterr().err
    with pytest.raises(ckptio.DataLossError):
        ckptio.load(uri, step=1)


def test_a_module_is_saved_as_its_state_dict_and_loads_into_another(tmp_path):
    uri = tmp_path / "model"
    model = model_of(2)
    ckptio.save(model, uri)
    other = model_of(3)
    other.load_state_dict(ckptio.load(uri))
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"state\['value'\]"):
        ckptio.save(lambda: 0, uri)


def test_a_one_liner_load_reads_while_a_checkpointer_holds_the_store(tmp_path):
    uri = str(tmp_path / "store")
    ckpt = ckptio.Checkpointer(uri)  # the writer lock, held
    ckpt.save(0, {"value": torch.full((4,), 7.0)})
    assert torch.equal(ckptio.load(uri), torch.full((4,), 7.0))
    del ckpt  # (a one-liner save would wait for its writer lock, up to 30 s)
    ckptio.save(torch.zeros(1), uri)
    assert torch.equal(ckptio.load(uri), torch.zeros(1))
