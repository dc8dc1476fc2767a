"""What every test of this folder needs: a temporary folder on a local file
system. On a network or FUSE one, ckptio's POSIX backend works in lease mode
(each writer's objects in a folder of its own), and tests that name object
paths would fail for that reason alone; the run stops at once instead,
saying why (as the C++ tests' TempDir does)."""
import os
import re
import tempfile

import pytest

# File system types, as /proc/self/mountinfo names them, that the POSIX
# backend takes for network file systems (its IsNetworkFileSystem, by
# statfs magic); every "fuse" and "fuse.*" type too.
NETWORK_TYPES = {"nfs", "nfs4", "smbfs", "cifs", "smb3", "9p", "ceph", "afs", "coda", "ncpfs",
                 "lustre", "gpfs", "beegfs", "orangefs", "pvfs2"}


def file_system_type(path):
    """The type of the file system `path` is on (the deepest mount holding
    it, the last mounted there); None if /proc/self/mountinfo is unreadable
    or shows no mount holding it (in a chroot whose root is not a mount
    point), where the run goes on unchecked."""
    path = os.fsencode(os.path.realpath(path))
    best, kind = None, None
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = f.read()
    except OSError:
        return None
    for line in table.splitlines():
        fields = line.split()
        if b"-" not in fields:
            continue
        # Spaces and other odd bytes are octal escapes ("\040").
        mount = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
        inside = path == mount or path.startswith(mount.rstrip(b"/") + b"/")
        if inside and (best is None or len(mount) >= len(best)):
            best, kind = mount, fields[fields.index(b"-") + 1].decode("ascii", "replace")
    return kind


def pytest_configure(config):
    base = config.option.basetemp or tempfile.gettempdir()
    kind = file_system_type(base)
    if kind and (kind in NETWORK_TYPES or kind == "fuse" or kind.startswith("fuse.")
                 or kind == "fuseblk"):
        raise pytest.UsageError(
            f"the tests' temporary folder {base} is on a network or FUSE file system ({kind}), "
            "where ckptio's POSIX backend works in lease mode and these tests would fail for "
            "that reason alone: set TMPDIR to a folder on a local file system (ext4, xfs, "
            "tmpfs, ...)")
