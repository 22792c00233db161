#!/usr/bin/env python3
"""Checks that kvlens's floors run one way (README "Map of the code"), from the sources' includes.

Fails (exit 1, one line per finding) when
  - a file includes a header of a room its own room may not use (an upward include);
  - a kernel file includes a compression-policy header (kernels know formats, never methods);
  - a file outside models/ names LlavaModel (everything else talks to the model interface);
  - code outside a method's own file special-cases it by name: compares a method name with
    == / !=, or asks find_method / make_params / make_policy / parse_method_spec for it.

Usage: tests/floors.py [REPO]   (default: the repository this script is in)
       tests/floors.py --self-test  (a made-up tree with one finding of each kind must fail)
"""
import os
import re
import sys

# Each room, and the rooms it may include (its own included). Longest prefix wins.
ROOMS = {
    "core": [],
    "core/data": ["core"],
    "core/compress": ["core"],
    "core/diagnostics": ["core", "core/compress"],
    "core/eval": ["core", "core/compress"],
    "kernels": ["core"],
    "models": ["core", "core/data", "core/compress", "kernels"],
    "app/lab": ["core", "core/data", "core/compress", "core/diagnostics", "core/eval", "kernels", "models"],
    "app/figures": ["core", "core/data", "core/compress", "core/diagnostics", "core/eval", "app/lab"],
    "app/cli": None,  # the top floor: anything below
    "app/bench": None,
    "app/gui": None,
}
SOURCE = re.compile(r"\.(h|hpp|cpp|cu|cuh)$")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def room_of(path):
    """The room of a repository path: the longest ROOMS key it lies under ('kernels/...' is one room)."""
    best = None
    for r in ROOMS:
        if path == r or path.startswith(r + "/"):
            if best is None or len(r) > len(best):
                best = r
    return best


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def method_names(repo):
    """Registered method names: each core/compress/methods/<file>.cpp's m.name / s.name values."""
    names = {}
    d = os.path.join(repo, "core/compress/methods")
    for f in sorted(os.listdir(d)):
        if not f.endswith(".cpp"):
            continue
        text = open(os.path.join(d, f), encoding="utf-8").read()
        for n in re.findall(r'\b\w+\.name\s*=\s*"([a-z0-9_-]+)"', text):
            names[n] = "core/compress/methods/" + f
    # "full" also names the uncompressed reference of every report and table, and HF's
    # vision_feature_select_strategy value: a word, not a special case of the method.
    names.pop("full", None)
    return names


def self_test():
    """Each kind of finding, planted once in a made-up tree, is found; the clean tree passes."""
    import subprocess
    import tempfile
    planted = {
        "core/compress/methods/foo.cpp": 'void f() { m.name = "foo"; }\n',
        "core/kv_store.h": '#include "models/model.h"\n',                    # upward include
        "kernels/cuda/k.cu": '#include "core/compress/policy.h"\n',          # upward + policy header
        "app/lab/run.cpp": "LlavaModel m; // LlavaModel in a comment is fine\n",  # names LlavaModel
        "app/figures/f.cpp": 'bool g(P p) { return p.method() == "foo"; }\n',    # by name
        "app/cli/ok.cpp": '#include "models/model.h"\n// == "foo" in a comment\n',
    }
    with tempfile.TemporaryDirectory() as d:
        for rel, text in planted.items():
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w", encoding="utf-8") as fh:
                fh.write(text)
        out = subprocess.run([sys.executable, __file__, d], capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if not l.startswith("floors:")]
    want = ["core/kv_store.h: includes models/model.h", "kernels/cuda/k.cu: includes core/compress/policy.h",
            "kernels/cuda/k.cu: a kernel includes the policy header", "app/lab/run.cpp: names LlavaModel",
            "app/figures/f.cpp: special-cases the method 'foo'"]
    missing = [w for w in want if not any(l.startswith(w) for l in lines)]
    if out.returncode != 1 or missing or len(lines) != len(want):
        print("self-test failed: exit %d, missing %s, got:\n%s" % (out.returncode, missing, out.stdout))
        return 1
    print("floors self-test: %d planted findings found, nothing else" % len(want))
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    repo = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    findings = []
    files = []
    for top in ("core", "kernels", "models", "app"):
        for dirpath, _, names in os.walk(os.path.join(repo, top)):
            for n in names:
                if SOURCE.search(n):
                    files.append(os.path.relpath(os.path.join(dirpath, n), repo))
    methods = method_names(repo)
    if not methods:
        findings.append("core/compress/methods: no method names found (the check would be empty)")
    by_name = re.compile(
        r'(?:[=!]=\s*"(%s)"|"(%s)"\s*[=!]=|\b(?:find_method|make_params|make_policy|parse_method_spec)\(\s*"(%s)[":])'
        % (("|".join(map(re.escape, methods)),) * 3))
    for f in sorted(files):
        text = open(os.path.join(repo, f), encoding="utf-8").read()
        room = room_of(f)
        allowed = ROOMS.get(room, [])
        for inc in INCLUDE.findall(text):
            target = room_of(inc)
            if target is None:
                continue  # a third-party header or one beside the file
            if allowed is not None and target != room and target not in allowed:
                findings.append(f"{f}: includes {inc} ({target} is not a floor below {room})")
            if room == "kernels" and inc.startswith("core/compress/"):
                findings.append(f"{f}: a kernel includes the policy header {inc}")
        code = strip_comments(text)
        if not f.startswith("models/") and re.search(r"\bLlavaModel\b", code):
            findings.append(f"{f}: names LlavaModel (use the model interface, models/model.h)")
        for m in by_name.finditer(code):
            name = next(g for g in m.groups() if g)
            if methods.get(name) != f:
                findings.append(f"{f}: special-cases the method '{name}' by name ({m.group(0).strip()})")
    for line in findings:
        print(line)
    print(f"floors: {len(files)} files, {len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
