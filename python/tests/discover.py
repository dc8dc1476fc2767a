"""Writes a ctest file with one test per pytest test of this folder (as
gtest_discover_tests does for GoogleTest), so that the suite's summary
counts each.

  discover.py PYTHON TESTS_DIR OUT_FILE ENV...

A collection that fails (the package does not import) becomes one test
that fails with pytest's output: never a suite that silently ran nothing.
"""
import os
import subprocess
import sys


def bracket(s):
    return "[==[" + s + "]==]"


def main():
    python, tests_dir, out_file, env = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    run_env = dict(os.environ)
    for e in env:
        k, _, v = e.partition("=")
        run_env[k] = v
    got = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", tests_dir], capture_output=True, text=True,
                         env=run_env, cwd=tests_dir)
    ids = [line for line in got.stdout.splitlines() if "::" in line]
    # A test pytest skips is a skipped test for ctest too (never a silent
    # pass), its reason printed (-rs).
    props = ("ENVIRONMENT " + bracket(";".join(env)) + " LABELS python TIMEOUT 600 "
             "SKIP_REGULAR_EXPRESSION " + bracket("[0-9]+ skipped"))
    lines = []
    if got.returncode != 0 or not ids:
        lines.append(f"add_test(python_collect {bracket(python)} -m pytest --collect-only -q "
                     f"-p no:cacheprovider {bracket(tests_dir)})")
        lines.append(f"set_tests_properties(python_collect PROPERTIES {props} "
                     f"WORKING_DIRECTORY {bracket(tests_dir)})")
    for node in ids:
        name = "python." + node.replace(".py::", ".", 1)
        lines.append(f"add_test({bracket(name)} {bracket(python)} -m pytest -q -rs -p "
                     f"no:cacheprovider {bracket(node)})")
        # The s3:// tests use the S3 server of ctest's fixture "s3".
        extra = " FIXTURES_REQUIRED s3" if node.startswith("test_s3.py::") else ""
        lines.append(f"set_tests_properties({bracket(name)} PROPERTIES {props}{extra} "
                     f"WORKING_DIRECTORY {bracket(tests_dir)})")
    with open(out_file + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(out_file + ".tmp", out_file)


if __name__ == "__main__":
    main()
