#!/usr/bin/env bash
# `cmake --install` puts the Python package where python3 finds it, working
# from there (its extension finds the installed libraries, not the build's).
# Usage: install_test.sh BUILD_DIR PYTHON [CMAKE]
set -euo pipefail
build=$1 python=$2 cmake=${3:-cmake}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null
package=$(find "$tmp/prefix" -path '*-packages/ckptio/__init__.py' | head -1)
[ -n "$package" ] || { echo "install_test: no ckptio package under $tmp/prefix"; exit 1; }
site=$(dirname "$(dirname "$package")")
echo "install_test: installed in ${site#"$tmp/prefix/"}"
# From elsewhere, with only the installed package on the path.
cd "$tmp"
env -u PYTHONPATH PYTHONPATH="$site" "$python" - "$tmp/store" <<'PY'
import sys
import torch
import ckptio
assert "/prefix/" in ckptio.__file__, ckptio.__file__  # not the build tree's
model = torch.nn.Linear(3, 2)
ckpt = ckptio.Checkpointer(sys.argv[1])
ckpt.save(1, {"model": model})
other = torch.nn.Linear(3, 2)
assert ckpt.load({"model": other}) == 1
assert torch.equal(other.weight, model.weight)
print("install_test: import ckptio from", ckptio.__file__, "saved and loaded step 1")
PY
# Its extension resolves ckptio's libraries inside the prefix.
ext=$(find "$(dirname "$package")" -name '_ckptio*.so' | head -1)
if ldd "$ext" | grep -F "$build/lib" >/dev/null; then
  echo "install_test: $ext loads libraries from the build tree:"; ldd "$ext" | grep ckptio; exit 1
fi
