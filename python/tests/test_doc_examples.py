"""Every ```python block of README.md and docs/PYTHON.md runs as written
(its store path moved into a temporary folder), twice: the second run
resumes from what the first saved."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", os.path.join("docs", "PYTHON.md")]


def examples():
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            yield pytest.param(block, id=f"{doc}#{i}")


@pytest.mark.parametrize("code", list(examples()))
def test_example_runs_and_resumes(code, tmp_path):
    if "torch.distributed.checkpoint" in code:
        pytest.importorskip("torch.distributed.checkpoint",
                            reason="this PyTorch has no torch.distributed.checkpoint (>= 2.0): "
                                   "tools/torch2-check.sh runs the example with PyTorch 2.6")
    paths = set(re.findall(r'"(/tmp/[^"]+)"', code))
    for p in paths:
        code = code.replace(p, str(tmp_path / os.path.basename(p)))
    script = tmp_path / "example.py"
    script.write_text(code)
    for run in range(2):
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             cwd=tmp_path, timeout=300)
        assert out.returncode == 0, f"run {run}:\n{out.stdout}\n{out.stderr}"
