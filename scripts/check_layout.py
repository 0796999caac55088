#!/usr/bin/env python3
"""The source tree's folders include each other without a cycle, and contracts/
includes nothing from ops/ (a judge that calls the code it judges cannot catch
that code's bugs). Reads every #include "path" of the C and C++ files under the
repository root that names a file there; prints each cycle of folders (with one
include that closes each edge) and each contracts -> ops include; exit 1 if
there is one."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = (".c", ".h", ".cpp", ".hpp")


def sources():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(ROOT)
                 if "/build" not in d and "/.git" not in d for f in fs]
    return [f for f in files if f.endswith(SOURCES) and os.path.isfile(os.path.join(ROOT, f))]


def edges(files):
    """folder -> {folder: 'file includes path'} over the includes that cross folders."""
    out = {}
    for f in files:
        with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as text:
            for path in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text.read(), re.M):
                if not os.path.isfile(os.path.join(ROOT, path)):
                    continue
                a, b = os.path.dirname(f), os.path.dirname(path)
                if a != b:
                    out.setdefault(a, {}).setdefault(b, "{} includes {}".format(f, path))
    return out


def cycles(graph):
    """The strongly connected components of more than one folder (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main():
    files = sources()
    graph = edges(files)
    bad = 0
    for comp in cycles(graph):
        bad += 1
        print("folder cycle: " + " <-> ".join(comp))
        for a in comp:
            for b in comp:
                if b in graph.get(a, {}):
                    print("  " + graph[a][b])
    for a in sorted(graph):
        if a == "contracts" or a.startswith("contracts/"):
            for b, why in sorted(graph[a].items()):
                if b == "ops" or b.startswith("ops/"):
                    bad += 1
                    print("contracts includes ops: " + why)
    if bad:
        return 1
    print("check_layout: {} source files, no folder cycle, contracts/ free of ops/".format(len(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
