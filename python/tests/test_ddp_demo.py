"""The Python DDP demo (tools/ddp_demo.py), 4 real ranks started by
ckptio-launch: a run whose rank 0 is SIGKILLed while writing a step, then
relaunched, ends bit-identical to an uninterrupted run; the killed step is
never committed, and every waiting rank reports the dead writer."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "tools", "ddp_demo.py")


def launch(bin_dir, store, *extra, ranks=4):
    out = subprocess.run(
        [os.path.join(bin_dir, "ckptio-launch"), "-n", str(ranks), "--grace", "20", "--",
         sys.executable, DEMO, "--store", store, "--steps", "40", "--every", "10", *extra],
        capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


def hash_of(log):
    lines = [l for l in log.splitlines() if l.startswith("final parameter hash: ")]
    assert len(lines) == 1, log
    return lines[0].split(": ")[1]


def test_killed_mid_save_and_resumed_ends_bit_identical(tmp_path):
    bin_dir = os.environ.get("CKPTIO_BIN")
    if not bin_dir:
        pytest.skip("CKPTIO_BIN (the build's bin folder, with ckptio-launch) is not set: "
                    "ctest sets it")
    rc, clean = launch(bin_dir, str(tmp_path / "clean"))
    assert rc == 0, clean

    store = str(tmp_path / "run")
    rc, killed = launch(bin_dir, store, "--kill-rank0-during-save=20")
    assert rc != 0 and "rank 0 killed by signal 9" in killed, killed
    assert killed.count("writer died before committing step 20") == 3, killed
    listed = subprocess.run([os.path.join(bin_dir, "ckptio"), "ls", "--json", store],
                            capture_output=True, text=True, check=True).stdout
    states = {s["step"]: s["state"] for s in json.loads(listed)["steps"]}
    assert states == {10: "committed", 20: "torn"}, states

    rc, resumed = launch(bin_dir, store)
    assert rc == 0 and "resumed from step 10" in resumed, resumed
    assert hash_of(resumed) == hash_of(clean)
