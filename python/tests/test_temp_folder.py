"""The suite's own check (conftest.py): a temporary folder on a network or
FUSE file system stops the run, saying why; a local one does not."""
import subprocess
import types

import pytest

import conftest


def config(basetemp):
    return types.SimpleNamespace(option=types.SimpleNamespace(basetemp=str(basetemp)))


def test_file_system_types_are_read_from_the_mount_table(tmp_path):
    assert conftest.file_system_type("/proc/self") == "proc"
    # A mount point whose name needs escaping in the table (a space) and
    # is not ASCII, where this machine lets a test mount a tmpfs.
    mount = tmp_path / "a folder \u00e9"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "none", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): the escaped name is not checked")
    try:
        assert conftest.file_system_type(mount / "x") == "tmpfs"
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_temporary_folder_on_a_network_file_system_stops_the_run(tmp_path, monkeypatch):
    real_type = conftest.file_system_type
    monkeypatch.setattr(conftest, "file_system_type", lambda path: "fuse.sshfs")
    with pytest.raises(pytest.UsageError, match=r"network or FUSE file system \(fuse.sshfs\)"):
        conftest.pytest_configure(config(tmp_path))
    monkeypatch.setattr(conftest, "file_system_type", real_type)
    kind = conftest.file_system_type(tmp_path)
    if kind is None:
        pytest.skip("the mount table does not show the mount holding " + str(tmp_path) +
                    " (a chroot whose root is not a mount point): its own type is not checked")
    conftest.pytest_configure(config(tmp_path))  # local here: no error
    # As if this file system were a network one.
    monkeypatch.setattr(conftest, "NETWORK_TYPES", conftest.NETWORK_TYPES | {kind})
    with pytest.raises(pytest.UsageError, match="set TMPDIR to a folder on a local file system"):
        conftest.pytest_configure(config(tmp_path))
