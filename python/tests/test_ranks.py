"""Real processes as the ranks of a job (the launcher's environment, and
torch.distributed with Gloo for the c10d store): in each wait mode rank 1
returns from save only once rank 0 committed, and both load the same step;
a striped save splits the tensors alike on every rank;
a rank 0 that dies is seen by the waiting rank as WriterDiedError; Ctrl-C
ends every wait at once."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import torch.distributed as dist
    import ckptio

    wait, store, scenario = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    if wait == "store":
        dist.init_process_group("gloo")
    ckpt = ckptio.Checkpointer(store, wait=wait, timeout=60, stripe=scenario == "stripe")
    if scenario == "stripe":
        # Every rank writes its share; rank 1 built its dict in the other
        # order, and tensors of equal size tie in the split: the split must
        # not depend on the order (rank 0 refuses a part it did not expect).
        names = [f"t{i}" for i in range(9)]
        if rank == 1:
            names.reverse()
        state = {n: torch.full((256 * (1 + int(n[1:]) % 3),), float(n[1:])) for n in names}
        ckpt.save(1, state)
        parts = [f for f in os.listdir(os.path.join(store, "step-000000000001")) if ".part-" in f]
        assert parts, "no part object: the save was not striped"
        got = dict.fromkeys(names)
        assert ckpt.load(got, map_location="cpu") == 1
        assert all(torch.equal(got[n], state[n]) for n in names), "a tensor came back different"
        print("RANK", rank, "OK")
        sys.exit(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    state = {"model": model, "epoch": 1}
    if scenario.startswith("interrupt-"):
        # Rank 0 is alive and never saves: rank 1 waits until Ctrl-C.
        if rank == 0:
            print("READY", flush=True)
            time.sleep(120)
            sys.exit(0)
        call = {"interrupt-save": lambda: ckpt.save(1, state),
                "interrupt-load": lambda: ckpt.load(state),
                "interrupt-future": lambda: ckpt.save_async(1, state).result()}[scenario]
        print("WAITING", flush=True)
        t0 = time.monotonic()
        try:
            call()
        except KeyboardInterrupt:
            print(f"INTERRUPTED after {time.monotonic() - t0:.2f} s", flush=True)
            sys.exit(0)
        sys.exit("the wait ended without Ctrl-C")
    if scenario == "die":
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            ckpt.save(1, state)
        except ckptio.WriterDiedError as e:
            print("WRITER DIED:", e)
            sys.exit(0)
        sys.exit("rank 1 saved although rank 0 died")
    ckpt.save(1, state)
    # Rank 1 returned: the step is committed, whatever rank 0 does now.
    assert os.path.exists(os.path.join(store, "step-000000000001", "MANIFEST.json"))
    other = torch.nn.Linear(4, 4)
    got = {"model": other, "epoch": 0}
    assert ckpt.load(got) == 1, "no step"
    assert got["epoch"] == 1 and torch.equal(other.weight, model.weight)
    print("RANK", rank, "OK")
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(tmp_path, wait, scenario, world=2):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = str(tmp_path / "store")
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   CKPTIO_JOB_ID=f"pytest-{tmp_path.name}",
                   # PyTorch >= 2.4 asks TCPStore for libuv, which Debian's lacks.
                   USE_LIBUV="0")
        procs.append(subprocess.Popen([sys.executable, str(script), wait, store, scenario],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def run_ranks(tmp_path, wait, scenario, world=2):
    procs = start_ranks(tmp_path, wait, scenario, world)
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        outs.append((p.returncode, out))
    return outs


@pytest.mark.parametrize("wait", ["file-lock", "manifest", "store"])
def test_the_waiting_rank_returns_after_the_commit_and_both_load_it(tmp_path, wait):
    for rank, (rc, out) in enumerate(run_ranks(tmp_path, wait, "ok")):
        assert rc == 0 and f"RANK {rank} OK" in out, f"rank {rank}:\n{out}"


def test_a_striped_save_splits_alike_whatever_order_each_rank_built_its_state_in(tmp_path):
    for rank, (rc, out) in enumerate(run_ranks(tmp_path, "file-lock", "stripe")):
        assert rc == 0 and f"RANK {rank} OK" in out, f"rank {rank}:\n{out}"


def test_a_dead_rank_0_is_a_writer_died_error_on_the_waiting_rank(tmp_path):
    (rc0, out0), (rc1, out1) = run_ranks(tmp_path, "file-lock", "die")
    assert rc0 == -9, out0
    assert rc1 == 0 and "WRITER DIED" in out1, out1


# Each wait mode and each call once (the waits share one loop in the core).
@pytest.mark.parametrize("wait,call", [("file-lock", "load"), ("manifest", "future"),
                                       ("store", "save")])
def test_ctrl_c_ends_a_wait_promptly_with_keyboard_interrupt(tmp_path, wait, call):
    rank0, rank1 = start_ranks(tmp_path, wait, "interrupt-" + call)
    try:
        for rank, word in ((rank0, "READY"), (rank1, "WAITING")):
            # (PyTorch 2.x may warn first on the same stream)
            lines = []
            while not lines or lines[-1].strip() != word:
                lines.append(rank.stdout.readline())
                assert lines[-1], "".join(lines)
        time.sleep(1.0)  # inside the wait (its timeout is 60 s)
        rank1.send_signal(signal.SIGINT)
        out, _ = rank1.communicate(timeout=20)
        assert rank1.returncode == 0 and "INTERRUPTED after" in out, out
        waited = float(out.split("INTERRUPTED after ")[1].split()[0])
        assert waited < 5, f"Ctrl-C took {waited - 1:.1f} s to end the wait"
    finally:
        for p in (rank0, rank1):
            p.kill()
            p.wait()
