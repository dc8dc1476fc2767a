"""A synchronous save streams from the tensors' own memory: saving a 1 GiB
state (a module and a tensor) raises the process's peak resident memory by
at most 64 MiB. Measured in a fresh process, by its high-water mark
(ru_maxrss), after a small save has paid the one-time costs (libraries,
threads)."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    import ckptio

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    store = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)])
    state = {"model": model, "extra": torch.ones(128 << 20)}  # 512 MiB + 512 MiB
    ckpt = ckptio.Checkpointer(store)
    ckpt.save(0, {"small": torch.ones(1 << 20)})  # the one-time costs
    before = peak_mib()
    ckpt.save(1, state)
    print(f"PEAK EXTRA MIB {peak_mib() - before:.1f}")
    # The control: the measure sees a copy of 128 MiB of the state.
    before = peak_mib()
    copy = state["extra"][: 32 << 20].clone()
    print(f"CONTROL MIB {peak_mib() - before:.1f}")
""")


def test_a_synchronous_save_of_1_gib_needs_at_most_64_mib_more(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    extra = float(out.stdout.split("PEAK EXTRA MIB ")[1].split()[0])
    print(f"peak extra memory of a synchronous 1 GiB save: {extra:.1f} MiB")
    assert extra <= 64, f"the save raised peak memory by {extra:.1f} MiB"
    control = float(out.stdout.split("CONTROL MIB ")[1].split()[0])
    assert control >= 120, f"a 128 MiB copy raised the measured peak by {control:.1f} MiB only"
    size = sum(os.path.getsize(os.path.join(tmp_path, "store", "step-000000000001", f))
               for f in os.listdir(os.path.join(tmp_path, "store", "step-000000000001")))
    assert size >= 1 << 30  # it did save the whole state
