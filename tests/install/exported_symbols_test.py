#!/usr/bin/env python3
"""Each ckptio library exports only its interface.

  exported_symbols_test.py SOURCE_DIR LIBRARY...

The libraries are built with hidden visibility; a public header marks what
is exported with CKPTIO_EXPORT, an internal header marks the few helpers the
tree's own tools and tests call with CKPTIO_EXPORT_PRIVATE. This test fails
when
  - a library exports a ckptio symbol whose class or function no header marks
    (an internal helper leaking into the interface, or the visibility preset
    gone: then hundreds do), or a symbol of a library ckptio uses inside
    (nlohmann-json, fmt, xxHash), which would clash with the user's copy;
  - a namespace-scope function declared in a public header is not marked
    (it would be declared to users but missing from the library);
  - a library exports nothing of ckptio at all.
Symbols of namespace std and LibTorch's (their headers give their types
default visibility, so instantiations such as typeinfo for a std::shared_ptr
control block stay visible wherever they are emitted) are allowed.
"""
import glob
import os
import re
import subprocess
import sys

MARK = re.compile(r"\bCKPTIO_EXPORT(?:_PRIVATE)?\b\s+([^;{]*)")
FUNC = re.compile(r"(?:operator\s*\S+?|[A-Za-z_]\w*)\s*(?=\()")
# Libraries whose headers give their own types default visibility: their
# template instantiations and typeinfo are emitted, visible, where used.
DEFAULT_VISIBILITY_NAMESPACES = ("std::", "__gnu_cxx::", "c10::", "at::", "torch::", "caffe2::")
PREFIXES = ("typeinfo name for ", "typeinfo for ", "vtable for ", "VTT for ",
            "construction vtable for ", "guard variable for ",
            "non-virtual thunk to ", "virtual thunk to ")


def headers(src):
    pats = ["include/ckptio/*.h", "plugins/*/include/ckptio/*.h", "src/*.h", "src/torch/*.h",
            "plugins/*/*.h"]
    return sorted(set(f for p in pats for f in glob.glob(os.path.join(src, p))))


def marked_names(src):
    names = set()
    for path in headers(src):
        text = re.sub(r"//[^\n]*|#define[^\n]*", "", open(path, encoding="utf-8").read())
        for m in MARK.finditer(text):
            line_start = text.rfind("\n", 0, m.start()) + 1
            if re.match(r"\s*(class|struct)\b", text[line_start:m.start()]):
                name = re.match(r"[A-Za-z_]\w*", m.group(1))  # class [[a]] CKPTIO_EXPORT Name
            else:  # CKPTIO_EXPORT Type Name(...), over one line or more
                name = FUNC.search(m.group(1))
            if name:
                names.add(re.sub(r"\s+", "", name.group(0)))
    return names


def unmarked_public_declarations(src):
    """Namespace-scope function declarations in public headers without the mark."""
    bad = []
    for path in glob.glob(os.path.join(src, "include/ckptio/*.h")) + \
            glob.glob(os.path.join(src, "plugins/*/include/ckptio/*.h")):
        stack = []
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            code = line.split("//")[0]
            at_namespace = all(k == "ns" for k in stack)
            if (at_namespace and code.strip() and not line[0].isspace()
                    and not line.startswith(("#", "}")) and "(" in code
                    and "CKPTIO_EXPORT" not in code
                    and not re.match(r"(inline|constexpr|template|using|namespace|enum|"
                                     r"extern \"C\")\b", code)):
                # the line after `template <...>` is a template: header-only
                prev = open(path, encoding="utf-8").read().split("\n")[n - 2]
                if not prev.startswith("template"):
                    bad.append(f"{os.path.relpath(path, src)}:{n}: {line.strip()}")
            for ch in re.sub(r'"[^"]*"', "", code):
                if ch == "{":
                    stack.append("ns" if re.match(r"\s*namespace\b", code) else "x")
                elif ch == "}" and stack:
                    stack.pop()
    return bad


def strip_templates(text):
    out, depth = [], 0
    for ch in text:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def qualified_name(symbol):
    """'void std::vector<T>::push_back(T&&)' -> 'std::vector::push_back'."""
    for p in PREFIXES:
        if symbol.startswith(p):
            symbol = symbol[len(p):]
    symbol = re.sub(r"operator\s*(<<|>>|<=|>=|<|>|\(\))", "operator@", symbol)
    head = strip_templates(symbol.replace("[abi:cxx11]", "")).split("(")[0].strip()
    return head.split(" ")[-1] if head else symbol


def top_entity(name):
    """'ckptio::Store::Open' -> 'Store'; None outside namespace ckptio."""
    if not name.startswith("ckptio::"):
        return None
    rest = name[len("ckptio::"):]
    if rest.startswith("internal::"):
        rest = rest[len("internal::"):]
    first = rest.split("::")[0]
    return "operator<<" if first == "operator@" else first


def main():
    src, libs = sys.argv[1], sys.argv[2:]
    allowed = marked_names(src)
    failures = [f"not marked CKPTIO_EXPORT: {d}" for d in unmarked_public_declarations(src)]
    for lib in libs:
        out = subprocess.run(["nm", "-D", "--defined-only", "-C", lib], check=True,
                             capture_output=True, text=True).stdout
        ours = 0
        for line in out.splitlines():
            parts = line.split(" ", 2)
            if len(parts) < 3:
                continue
            symbol = parts[2]
            if symbol.startswith("_") or "@@" in symbol:  # linker and versioned symbols
                continue
            name = qualified_name(symbol)
            if name.startswith(DEFAULT_VISIBILITY_NAMESPACES):
                continue
            entity = top_entity(name)
            if entity is None:
                failures.append(f"{os.path.basename(lib)}: exports a foreign symbol: {symbol}")
            elif entity not in allowed:
                failures.append(f"{os.path.basename(lib)}: exports unmarked {entity}: {symbol}")
            else:
                ours += 1
        if ours == 0:
            failures.append(f"{os.path.basename(lib)}: exports no ckptio symbol")
        print(f"{os.path.basename(lib)}: {ours} ckptio symbols exported")
    for f in failures[:60]:
        print("FAIL", f)
    if len(failures) > 60:
        print(f"... and {len(failures) - 60} more")
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
