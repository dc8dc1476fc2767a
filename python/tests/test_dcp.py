"""ckptio.dcp, the torch.distributed.checkpoint storage plugin (PyTorch >= 2.0;
Debian 12's 1.13 has no torch.distributed.checkpoint: these tests run in
the Debian 13 environment of tools/torch2-check.sh). One process, and real
Gloo ranks with state that differs per rank; a rank SIGKILLed mid-save
leaves nothing committed and the previous step loadable."""
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptio

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptio.dcp
except ImportError:  # PyTorch 1.x: each test is reported skipped, with this reason
    dcp = None
pytestmark = pytest.mark.skipif(
    dcp is None,
    reason=f"PyTorch {torch.__version__} has no torch.distributed.checkpoint (>= 2.0): "
           "tools/torch2-check.sh runs these tests with PyTorch 2.6")


def corrupt(path):
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")


def state_of(seed):
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(8, 4).state_dict(),
            "big": torch.randn(300, 70, dtype=torch.float64),
            "flags": torch.tensor([True, False, True]),
            "half": torch.randn(5).half(),
            "scalar": torch.tensor(3.5),
            "extra": {"lr": 0.25, "name": "run", "steps": [1, 2]}}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_a_lock_wait_without_a_finite_deadline_is_refused_at_once(tmp_path):
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ckptio.InvalidArgumentError, match="lock_wait="):
            ckptio.dcp.StorageWriter(tmp_path / "store", lock_wait=bad)


def test_one_process_saves_steps_and_loads_the_newest_good_one(tmp_path, capfd):
    uri = str(tmp_path / "store")
    first, second = state_of(0), state_of(1)
    dcp.save(first, storage_writer=ckptio.dcp.StorageWriter(uri))
    dcp.save(second, storage_writer=ckptio.dcp.StorageWriter(uri))
    assert sorted(d for d in os.listdir(uri) if d.startswith("step-")) == [
        "step-000000000000", "step-000000000001"]

    got = state_of(9)
    dcp.load(got, storage_reader=ckptio.dcp.StorageReader(uri))
    assert_same(got, second)
    got = state_of(9)
    dcp.load(got, storage_reader=ckptio.dcp.StorageReader(uri, step=0))
    assert_same(got, first)

    corrupt(os.path.join(uri, "step-000000000001", "dcp-0.bin"))
    got = state_of(9)
    dcp.load(got, storage_reader=ckptio.dcp.StorageReader(uri))
    assert_same(got, first)  # the damaged step 1 is skipped
    assert "step 1 failed verification" in capfd.readouterr().err
    with pytest.raises(CheckpointException, match="DataLossError"):
        dcp.load(state_of(9), storage_reader=ckptio.dcp.StorageReader(uri, step=1))


def test_a_checkpointer_step_a_held_store_and_a_taken_step_are_refused(tmp_path):
    uri = str(tmp_path / "store")
    held = ckptio.Checkpointer(uri)  # (its writer lock, held)
    held.save(0, {"w": torch.ones(2)})
    # (DCP raises what a storage plugin raised inside its CheckpointException)
    with pytest.raises(CheckpointException, match="not saved by torch.distributed"):
        dcp.load(state_of(0), storage_reader=ckptio.dcp.StorageReader(uri))
    with pytest.raises(CheckpointException, match="already has a writer"):
        dcp.save(state_of(0), storage_writer=ckptio.dcp.StorageWriter(uri, lock_wait=0))
    del held
    with pytest.raises(CheckpointException, match="already committed"):
        dcp.save(state_of(0), storage_writer=ckptio.dcp.StorageWriter(uri, step=0))


def test_a_reset_abandons_a_begun_step_and_frees_the_store(tmp_path):
    # DCP calls reset() at the start of every save: a writer whose last save
    # began a step and never finished (an exception between its global plan
    # and finish) gives the step and the store's writer lock up there.
    from torch.distributed.checkpoint.planner import SavePlan
    uri = str(tmp_path / "store")
    writer = ckptio.dcp.StorageWriter(uri, step=5)
    writer.prepare_global_plan([SavePlan([])])  # step 5 begun: the writer lock held
    with pytest.raises(CheckpointException, match="already has a writer"):
        dcp.save(state_of(0), storage_writer=ckptio.dcp.StorageWriter(uri, lock_wait=0))
    writer.reset(checkpoint_id=str(tmp_path / "other"))
    assert writer.uri == str(tmp_path / "other")
    dcp.save(state_of(1), storage_writer=ckptio.dcp.StorageWriter(uri, lock_wait=0))
    assert not os.path.exists(os.path.join(uri, "step-000000000005", "MANIFEST.json"))
    got = state_of(9)
    dcp.load(got, storage_reader=ckptio.dcp.StorageReader(uri))
    assert_same(got, state_of(1))  # step 0: the abandoned step 5 is no step at all


def test_the_cli_verifies_and_lists_a_dcp_step(tmp_path):
    bin_dir = os.environ.get("CKPTIO_BIN")
    if not bin_dir:
        pytest.skip("CKPTIO_BIN (the build's bin folder) is not set: ctest sets it")
    uri = str(tmp_path / "store")
    dcp.save(state_of(0), storage_writer=ckptio.dcp.StorageWriter(uri))
    out = subprocess.run([os.path.join(bin_dir, "ckptio"), "verify", uri, "latest"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


WORKER = textwrap.dedent("""
    import datetime, os, signal, sys, threading, time
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import ckptio.dcp

    store, scenario = sys.argv[1:3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()

    def state(seed):
        # Replicated ("common", saved once) and per rank ("own<r>"): sharded.
        g = torch.Generator().manual_seed(seed)
        return {"common": torch.randn(64, generator=g),
                f"own{rank}": torch.randn(2000, 1000, generator=g) + 100 * rank,
                "epoch": seed}

    class Dying(ckptio.dcp.StorageWriter):
        # Rank 1 dies while it writes its shard; rank 0 after every shard is
        # durable, just before it commits.
        def write_data(self, plan, planner):
            if scenario == "kill1" and rank == 1:
                threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGKILL)).start()
                super().write_data(plan, planner)
                time.sleep(30)
            return super().write_data(plan, planner)

        def finish(self, metadata, results):
            if scenario == "kill0":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().finish(metadata, results)

    if scenario in ("save", "first"):
        dcp.save(state(0), storage_writer=ckptio.dcp.StorageWriter(store))
        if scenario == "first":
            sys.exit(0)
    if scenario in ("kill0", "kill1"):
        try:
            dcp.save(state(1), storage_writer=Dying(store))
        except Exception as e:
            print("SAVE FAILED:", type(e).__name__, flush=True)
            os._exit(3)
        sys.exit("the save went through")
    got = state(7)
    dcp.load(got, storage_reader=ckptio.dcp.StorageReader(store))
    want = state(0)
    for k in want:
        assert (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor)
                else got[k] == want[k]), k
    print("RANK", rank, "LOADED STEP 0 OK", flush=True)
    dist.barrier()
    # A save after a failed one: the torn attempt at the step is cleared.
    dcp.save(state(2), storage_writer=ckptio.dcp.StorageWriter(store, step=1))
    got = state(7)
    dcp.load(got, storage_reader=ckptio.dcp.StorageReader(store))
    assert torch.equal(got[f"own{rank}"], state(2)[f"own{rank}"])
    print("RANK", rank, "OK", flush=True)
""")


def run_ranks(tmp_path, scenario, world=2):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   USE_LIBUV="0")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "store"), scenario], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return [(p.returncode, out) for p in procs for out, _ in [p.communicate(timeout=300)]]


def test_ranks_save_their_own_shards_and_load_them(tmp_path):
    for rank, (rc, out) in enumerate(run_ranks(tmp_path, "save")):
        assert rc == 0 and f"RANK {rank} OK" in out, f"rank {rank}:\n{out}"


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_save_leaves_the_previous_step_loadable(tmp_path, victim):
    for rank, (rc, out) in enumerate(run_ranks(tmp_path, "first")):
        assert rc == 0, f"rank {rank}:\n{out}"
    store = tmp_path / "store"
    outs = run_ranks(tmp_path, f"kill{victim}")
    assert outs[victim][0] == -9, outs[victim][1]
    survivor = outs[1 - victim]
    assert survivor[0] != 0, f"the other rank finished a save whose rank died:\n{survivor[1]}"
    assert not (store / "step-000000000001" / "MANIFEST.json").exists()
    for rank, (rc, out) in enumerate(run_ranks(tmp_path, "resume")):
        assert rc == 0 and "LOADED STEP 0 OK" in out and f"RANK {rank} OK" in out, (
            f"rank {rank}:\n{out}")
