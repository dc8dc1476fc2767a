"""One format for both languages: a step the C++ Checkpointer saved (the
C++ DDP demo trainer) loads into a Python module by parameter name, and a
step Python saved is read by the C++ tools (verify, export to a file
stock torch.load opens)."""
import os
import subprocess

import pytest
import torch

import ckptio

BIN = os.environ.get("CKPTIO_BIN", "build/bin")


def tool(name):
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        pytest.skip(f"no {name} in {BIN} (set CKPTIO_BIN to the build's bin folder)")
    return path


def expect_exported_module(store, step, model, tmp_path):
    """`ckptio export` of `step` holds `model`'s tensors under "model"."""
    exported = tmp_path / "exported.pt"
    out = subprocess.run([tool("ckptio"), "export", store, str(step), "-o", str(exported)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    saved = torch.load(str(exported))["model"]
    for name, t in model.state_dict().items():
        assert torch.equal(t, saved[name]), name


class Mlp(torch.nn.Module):  # the C++ demo's model (tools/ddp/ckptio_ddp_demo.cc)
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.fc3 = torch.nn.Linear(64, 1)


def test_a_cxx_saved_step_loads_into_a_python_module(tmp_path):
    store = str(tmp_path / "store")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([tool("ckptio-ddp-demo"), "--store", store, "--steps", "4",
                          "--every", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    model = Mlp()
    step = ckptio.Checkpointer(store).load({"model": model})
    assert step is not None
    # The same tensors the C++ tools export from that step.
    expect_exported_module(store, step, model, tmp_path)


def test_a_python_saved_step_is_read_by_the_cxx_tools(tmp_path):
    store = str(tmp_path / "store")
    torch.manual_seed(0)
    model = Mlp()
    ckptio.Checkpointer(store).save(7, {"model": model, "rng": torch.get_rng_state()})
    out = subprocess.run([tool("ckptio"), "verify", store, "7"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    expect_exported_module(store, 7, model, tmp_path)
