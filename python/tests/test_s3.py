"""ckptio over s3:// from Python, against the real S3 server (Ceph RGW) that
ctest's fixture starts (CKPTIO_RGW_DIR): the package binds the same core,
so a Checkpointer, the one-liners and their checks work on an object store
as on a disk; the file-lock wait mode is refused, naming the modes that
work; wrong credentials are a PermissionError."""
import os
import socket
import uuid
from urllib.parse import urlparse

import pytest
import torch

import ckptio


def server_env():
    folder = os.environ.get("CKPTIO_RGW_DIR")
    path = os.path.join(folder or "", "env")
    if not folder or not os.path.exists(path):
        pytest.skip("no S3 server: CKPTIO_RGW_DIR names none (ctest's fixture sets it; or run "
                    "tools/rgw-server.sh start DIR and set CKPTIO_RGW_DIR=DIR)")
    env = dict(line.strip().split("=", 1) for line in open(path) if "=" in line)
    endpoint = urlparse(env["AWS_ENDPOINT_URL"])
    try:
        socket.create_connection((endpoint.hostname, endpoint.port), timeout=2).close()
    except OSError:
        pytest.skip(f"the S3 server of {folder} is not running (tools/rgw-server.sh start {folder})")
    return env


@pytest.fixture
def s3(monkeypatch):
    """The server's settings in the environment; a fresh store URI."""
    env = server_env()
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return f"s3://{env['CKPTIO_S3_BUCKET']}/py-{uuid.uuid4().hex}"


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_a_checkpointer_saves_and_loads_over_s3(s3):
    net = model()
    optim = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(2, 64)).sum().backward()
    optim.step()
    ckpt = ckptio.Checkpointer(s3, wait="manifest", keep_last=2)
    for step in (10, 20, 30):
        ckpt.save(step, {"model": net, "optim": optim, "step": step})
    del ckpt  # its writer lease goes with it: the next Checkpointer is the store's writer

    fresh = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fresh_optim = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    state = {"model": fresh, "optim": fresh_optim, "step": 0}
    got = ckptio.Checkpointer(s3, wait="manifest").load(state, map_location="cpu")
    assert got == 30 and state["step"] == 30
    for a, b in zip(net.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_optim.state_dict()["state"][0]["momentum_buffer"].equal(
        optim.state_dict()["state"][0]["momentum_buffer"])
    # keep_last=2: step 10 was retired.
    with pytest.raises(ckptio.NotFoundError):
        ckptio.load(s3, step=10)


def test_the_one_liners_round_trip_over_s3(s3):
    obj = {"w": torch.arange(1000, dtype=torch.float32), "meta": {"lr": 0.5, "name": "run"}}
    ckptio.save(obj, s3)
    back = ckptio.load(s3, map_location="cpu")
    assert torch.equal(back["w"], obj["w"]) and back["meta"] == obj["meta"]


def test_the_file_lock_wait_mode_is_refused_naming_the_modes_that_work(s3, monkeypatch):
    # Rank 0 of two (a job of one rank has no one to wait, and no lock).
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"),
                       ("LOCAL_WORLD_SIZE", "2"), ("CKPTIO_JOB_ID", uuid.uuid4().hex)):
        monkeypatch.setenv(key, value)
    with pytest.raises(ckptio.UnimplementedError) as e:
        ckptio.Checkpointer(s3, wait="file-lock").save(1, {"w": torch.zeros(3)})
    assert "manifest" in str(e.value) and "store" in str(e.value), e.value


def test_wrong_credentials_are_a_permission_error(s3, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(PermissionError) as e:
        ckptio.save({"w": torch.zeros(3)}, s3)
    assert "SignatureDoesNotMatch" in str(e.value), e.value


def test_the_ddp_demo_killed_mid_save_over_s3_resumes_bit_identical(s3, tmp_path):
    """tools/ddp_demo.py on 4 ranks over s3:// (wait mode store: rank 0
    serves the job's TCPStore): rank 0 SIGKILLed once the step's first
    object is committed, the waiters report the lost store, the step is
    never committed, and the relaunch ends with an uninterrupted run's
    parameters."""
    import json
    import subprocess
    import sys
    bin_dir = os.environ.get("CKPTIO_BIN")
    if not bin_dir:
        pytest.skip("CKPTIO_BIN (the build's bin folder, with ckptio-launch) is not set: "
                    "ctest sets it")
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "tools", "ddp_demo.py")

    def launch(store, *extra):
        out = subprocess.run(
            [os.path.join(bin_dir, "ckptio-launch"), "-n", "4", "--grace", "20", "--",
             sys.executable, demo, "--store", store, "--steps", "40", "--every", "10",
             "--wait", "store", *extra], capture_output=True, text=True, timeout=300)
        return out.returncode, out.stdout + out.stderr

    def hash_of(log):
        lines = [l for l in log.splitlines() if l.startswith("final parameter hash: ")]
        assert len(lines) == 1, log
        return lines[0].split(": ")[1]

    rc, clean = launch(str(tmp_path / "clean"))
    assert rc == 0, clean
    rc, killed = launch(s3, "--kill-rank0-during-save=20")
    assert rc != 0 and "rank 0 killed by signal 9" in killed, killed
    assert killed.count("lost the c10d store while waiting for rank 0 to commit step 20") == 3, \
        killed
    listed = subprocess.run([os.path.join(bin_dir, "ckptio"), "ls", "--json", s3],
                            capture_output=True, text=True, check=True).stdout
    states = {s["step"]: s["state"] for s in json.loads(listed)["steps"]}
    assert states == {10: "committed", 20: "torn"}, states
    rc, resumed = launch(s3)
    assert rc == 0 and "resumed from step 10" in resumed, resumed
    assert hash_of(resumed) == hash_of(clean)
