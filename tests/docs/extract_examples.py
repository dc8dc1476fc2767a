#!/usr/bin/env python3
"""Extracts the C++ examples of the docs and the public headers, so that the
build compiles every one of them as shown (tests/docs/CMakeLists.txt).

Where examples are found:
  * Markdown: README.md and docs/*.md. Every fenced block tagged ```cpp is an
    example. A fence must name its language (```sh, ```cmake, ```text, ...):
    an untagged fence, or C++ under another tag (```c++, ```cc, ```cxx), is an
    error, so no C++ example can slip past the compiler.
  * Headers: include/ckptio/*.h and plugins/*/include/ckptio/*.h. An example
    is a comment line "// Example:" (a title may follow the colon), then the
    code on the next comment lines, indented by at least two spaces after
    "//"; it ends at the first line that is neither such a line nor a bare
    "//". An indented comment line that looks like C++ code (a ckptio::
    name, "auto x =", "(*x)->", a call, ending in ; { or }) outside such a
    block is an error: mark it as an example or reword it.

How an example becomes a translation unit:
  * A block with "int main(" is a whole program and is compiled as it is.
  * Any other block is a snippet: its #include lines stay at the top, the
    rest becomes the body of a function that returns int (so a snippet may
    "return 1;" to stop, as a trainer's main would). A snippet that includes
    <ckptio/torch.h> (and every example of torch.h) is a torch snippet; its
    function has these names in scope, as a trainer has them:
        torch::nn::Linear& model;  torch::optim::Optimizer& optimizer;
        int64_t steps;  void TrainStep();
    Other snippets see only what they include (<ckptio/ckptio.h> and
    <ckptio/backends.h> when they include nothing; a header's own example
    also sees that header).
  * "#line" directives point the compiler's messages at the doc's own lines.

Usage:
  extract_examples.py extract ROOT OUT   write OUT/<id>.cc, OUT/examples.cmake
                                         (the lists for CMake) and
                                         OUT/examples.txt (what was extracted);
                                         files are rewritten only when changed
  extract_examples.py check ROOT OUT [--skip-torch] [TARGET=BINARY ...]
                                         exit 1 if a relative link of a page
                                         names nothing in the repository, a
                                         block is malformed or
                                         unmarked, was not extracted by the
                                         last build, or its target's binary is
                                         missing or older than its source;
                                         --skip-torch: the build has no LibTorch,
                                         torch examples are listed, not checked
"""

import glob
import hashlib
import os
import re
import sys

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([^`\s]*)")
CPP_SPELLINGS = {"c++", "cc", "cxx", "cpp", "hpp", "hxx", "h", "cuda"}
MAIN = re.compile(r"^\s*int\s+main\s*\(", re.M)
CODE_LIKE = re.compile(r"\bckptio::\w|\bauto\s+\w+\s*=|\(\*\w+\)->|[A-Za-z_]\w*\([^()]*\)\s*;")
ENDS_LIKE_CODE = re.compile(r"[;{}]\s*$")
MARKER = re.compile(r"^\s*// Example:")
TORCH_HEADER = "include/ckptio/torch.h"


class Example:
    def __init__(self, source, line, code, header=None):
        self.source = source  # relative to ROOT
        self.line = line  # 1-based line of the first code line
        self.code = code  # list of lines
        self.header = header  # "ckptio/x.h" for a header's example
        self.program = bool(MAIN.search("\n".join(code)))
        self.torch = header == "ckptio/torch.h" or any(
            re.match(r"\s*#\s*include\s*[<\"]ckptio/torch\.h[>\"]", l) for l in code)
        self.id = re.sub(r"[^A-Za-z0-9]+", "_", source).strip("_") + "_" + str(line)
        digest = hashlib.sha256("\n".join(code).encode()).hexdigest()[:12]
        self.key = "%s:%d %s" % (source, line, digest)

    def target(self):
        if self.program:
            return "doc_example_" + self.id
        return "doc_snippets_torch" if self.torch else "doc_snippets_core"


def code_part(text):
    """The text of a comment line without a trailing "// ..." remark."""
    return re.split(r"\s//(?:\s|$)", text)[0]


def scan_markdown(root, rel, examples, errors):
    lines = open(os.path.join(root, rel), encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, tag = m.group(1), m.group(2), m.group(3)
        start = i + 1
        j = start
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j == len(lines):
            errors.append("%s:%d: a fenced block that never ends" % (rel, i + 1))
            return
        body = [l[len(indent):] if l.startswith(indent) else l for l in lines[start:j]]
        if tag == "cpp":
            examples.append(Example(rel, start + 1, body))
        elif not tag:
            errors.append("%s:%d: a fence without a language: tag it (```cpp is compiled; "
                          "```text, ```sh, ```cmake are not)" % (rel, i + 1))
        elif tag.lower() in CPP_SPELLINGS:
            errors.append("%s:%d: C++ tagged ```%s: tag it ```cpp so that tests/docs "
                          "compiles it" % (rel, i + 1, tag))
        else:
            for k, l in enumerate(body):
                if CODE_LIKE.search(l) and ENDS_LIKE_CODE.search(code_part(l)) and \
                        "ckptio::" in l and tag not in ("sh", "cmake"):
                    errors.append("%s:%d: C++ in a ```%s block: tag it ```cpp" %
                                  (rel, start + k + 1, tag))
                    break
        i = j + 1


def scan_header(root, rel, examples, errors):
    lines = open(os.path.join(root, rel), encoding="utf-8").read().split("\n")
    header = rel[rel.index("ckptio/"):]
    i = 0
    while i < len(lines):
        if MARKER.match(lines[i]):
            start = i + 1
            j = start
            body = []
            while j < len(lines):
                s = lines[j].strip()
                if s == "//":
                    body.append("")
                elif s.startswith("//  ") and lines[j].lstrip().startswith("//  "):
                    body.append(s[2:])
                else:
                    break
                j += 1
            while body and not body[-1].strip():
                body.pop()
            if not body:
                errors.append("%s:%d: \"// Example:\" with no indented code after it" %
                              (rel, i + 1))
            else:
                depth = min(len(l) - len(l.lstrip()) for l in body if l.strip())
                examples.append(Example(rel, start + 1, [l[depth:] for l in body], header))
            i = max(j, i + 1)
            continue
        s = lines[i].strip()
        if s.startswith("//  ") and CODE_LIKE.search(s) and ENDS_LIKE_CODE.search(
                code_part(s[2:])):
            errors.append("%s:%d: looks like example code but has no \"// Example:\" line "
                          "above it (tests/docs compiles marked examples only)" % (rel, i + 1))
        i += 1


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def check_links(root, rel, errors):
    """Every relative link of a page names a file of the repository (and a
    heading of it, after '#'): no link points outside the repository."""
    here = os.path.dirname(os.path.join(root, rel))
    in_fence = False
    for n, line in enumerate(open(os.path.join(root, rel), encoding="utf-8"), 1):
        if FENCE.match(line):
            in_fence = not in_fence
        if in_fence:
            continue
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # https://...: a page of the web, not of this repository
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(here, path)) if path else os.path.join(root, rel)
            if not full.startswith(root + os.sep) or not os.path.exists(full):
                errors.append("%s:%d: link %s names nothing in the repository" % (rel, n, target))
                continue
            if anchor and full.endswith(".md"):
                heads = {slug(h.lstrip("#")) for h in open(full, encoding="utf-8")
                         if h.startswith("#")}
                if anchor not in heads:
                    errors.append("%s:%d: link %s: no such heading" % (rel, n, target))


def scan(root):
    examples, errors = [], []
    docs = ["README.md"] + sorted(
        os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))
    for rel in docs:
        if os.path.exists(os.path.join(root, rel)):
            scan_markdown(root, rel, examples, errors)
            check_links(root, rel, errors)
    headers = sorted(glob.glob(os.path.join(root, "include", "ckptio", "*.h")) +
                     glob.glob(os.path.join(root, "plugins", "*", "include", "ckptio", "*.h")))
    for path in headers:
        scan_header(root, os.path.relpath(path, root), examples, errors)
    return examples, errors


def translation_unit(root, ex):
    src = os.path.join(root, ex.source).replace("\\", "/")
    out = ["// Generated by tests/docs/extract_examples.py from %s:%d. Do not edit." %
           (ex.source, ex.line)]
    if ex.program:
        out.append('#line %d "%s"' % (ex.line, src))
        out.extend(ex.code)
        return "\n".join(out) + "\n"
    includes = [(k, l) for k, l in enumerate(ex.code) if l.lstrip().startswith("#")]
    rest = [(k, l) for k, l in enumerate(ex.code) if not l.lstrip().startswith("#")]
    if ex.header:
        out.append("#include <%s>" % ex.header)
    elif not includes:
        out.append("#include <ckptio/backends.h>")
        out.append("#include <ckptio/ckptio.h>")
    for k, l in includes:
        out.append('#line %d "%s"' % (ex.line + k, src))
        out.append(l)
    out.append('#line 1 "%s (wrapped)"' % src)
    if ex.torch:
        out.append("inline void TrainStep() {}")
        out.append("int Example_%s([[maybe_unused]] torch::nn::Linear& model,\n"
                   "    [[maybe_unused]] torch::optim::Optimizer& optimizer,\n"
                   "    [[maybe_unused]] int64_t steps) {" % ex.id)
    else:
        out.append("int Example_%s() {" % ex.id)
    if rest:
        out.append('#line %d "%s"' % (ex.line + rest[0][0], src))
        prev = rest[0][0] - 1
        for k, l in rest:
            if k != prev + 1:
                out.append('#line %d "%s"' % (ex.line + k, src))
            out.append(l)
            prev = k
    out.append('#line 1 "%s (wrapped)"' % src)
    out.append("  return 0;")
    out.append("}")
    return "\n".join(out) + "\n"


def write_if_changed(path, text):
    try:
        if open(path, encoding="utf-8").read() == text:
            return
    except OSError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def extract(root, out):
    examples, errors = scan(root)
    for e in errors:
        print("extract_examples: " + e, file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    lists = {"core": [], "torch": []}
    programs = []
    listing = []
    for ex in examples:
        path = os.path.join(out, ex.id + ".cc")
        write_if_changed(path, translation_unit(root, ex))
        if ex.program:
            programs.append((ex.id, "torch" if ex.torch else "core", path))
        else:
            lists["torch" if ex.torch else "core"].append(path)
        listing.append("%s %s %s" % (ex.key, ex.target(), path))
    made = {ex.id + ".cc" for ex in examples}
    for old in glob.glob(os.path.join(out, "*.cc")):  # examples that moved or went
        if os.path.basename(old) not in made and os.path.basename(old) != "snippets_main.cc":
            os.remove(old)
    main = os.path.join(out, "snippets_main.cc")
    write_if_changed(main, "// Generated: the snippets are compiled and linked, not run.\n"
                     "int main() { return 0; }\n")
    cmake = ["# Generated by tests/docs/extract_examples.py. Do not edit."]
    cmake.append("set(CKPTIO_DOC_SNIPPETS_CORE %s)" % " ".join(lists["core"]))
    cmake.append("set(CKPTIO_DOC_SNIPPETS_TORCH %s)" % " ".join(lists["torch"]))
    cmake.append("set(CKPTIO_DOC_SNIPPETS_MAIN %s)" % main)
    cmake.append("set(CKPTIO_DOC_PROGRAMS %s)" % " ".join("%s:%s:%s" % p for p in programs))
    cmake.append("set(CKPTIO_DOC_SOURCES %s)" % " ".join(
        sorted({os.path.join(root, ex.source) for ex in examples})))
    write_if_changed(os.path.join(out, "examples.cmake"), "\n".join(cmake) + "\n")
    write_if_changed(os.path.join(out, "examples.txt"), "\n".join(listing) + "\n")
    return 0


def check(root, out, built):
    examples, errors = scan(root)
    try:
        extracted = {}
        for l in open(os.path.join(out, "examples.txt"), encoding="utf-8"):
            if l.strip():
                key_source, key_hash, target, path = l.split()
                extracted[key_source + " " + key_hash] = (target, path)
    except OSError as e:
        errors.append("%s: not extracted yet (build the tests first): %s" % (out, e))
        extracted = {}
    skip_torch = "--skip-torch" in built
    binaries = dict(b.split("=", 1) for b in built if "=" in b)
    for ex in examples:
        if skip_torch and ex.torch:
            continue
        got = extracted.get(ex.key)
        if got is None:
            errors.append("%s:%d: this example was not compiled by the last build "
                          "(rebuild: cmake --build)" % (ex.source, ex.line))
            continue
        target, path = got
        binary = binaries.get(target)
        if binary is None:
            errors.append("%s:%d: no target %s builds this example" %
                          (ex.source, ex.line, target))
        elif not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(path):
            errors.append("%s:%d: %s is missing or older than the example: the build failed "
                          "or did not run" % (ex.source, ex.line, binary))
    for e in errors:
        print(e)
    print("%d example(s) found, %d problem(s)" % (len(examples), len(errors)))
    for ex in examples:
        skipped = " (not built: no LibTorch)" if skip_torch and ex.torch else ""
        print("  %s:%d -> %s%s" % (ex.source, ex.line, ex.target(), skipped))
    return 1 if errors else 0


def main(argv):
    if len(argv) >= 3 and argv[0] == "extract":
        return extract(os.path.abspath(argv[1]), os.path.abspath(argv[2]))
    if len(argv) >= 3 and argv[0] == "check":
        return check(os.path.abspath(argv[1]), os.path.abspath(argv[2]), argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
