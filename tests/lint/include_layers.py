#!/usr/bin/env python3
"""Fails when a file in src/ includes a header its layer may not: the "may include" column of
docs/ARCHITECTURE.md section 1, enforced (issue 33 deliverable 5). One CMake target builds every
source with src/ as the include root, so the compiler accepts any "layer/x.h"; this scan is what
keeps data flowing down and each job out of the others' headers.

Every #include "..." in src/ must be "ferry.h" (the public API, which every layer may include)
or "LAYER/NAME.h", and LAYER/NAME.h must be allowed by RULES for the including file's layer
(or, for the few files the table names, for that file). Angle-bracket includes are the system's
and not looked at. When the table changes, change RULES with it (and the other way round).

Usage: include_layers.py SOURCE_DIR    scan SOURCE_DIR/src; exit 1 naming each violation
       include_layers.py --self-test   run the checker on synthetic trees, one forbidden include
                                       each, and on a clean one; exit 1 if it misjudges any"""
import os
import re
import shutil
import sys
import tempfile

JOBS = ("store", "refit", "mq", "control")
LAYERS = ("core", "transport", "directory") + JOBS + ("cli",)
RANK = dict({"core": 0, "transport": 1, "directory": 2, "cli": 4}, **{j: 3 for j in JOBS})

# What a service thread of the context uses: channel ownership and the inbox, the job runtime.
JOB_CALLS = ["transport/ctxcalls.h", "transport/job.h"]

# layer -> (what the table says, allowed header prefixes or exact paths). A prefix ends in "/".
RULES = {
    "core": ("core", ["core/"]),
    "transport": ("core, transport", ["core/", "transport/"]),
    "directory": ("core, directory (and the per-file transport headers below)",
                  ["core/", "directory/"]),
    "store": ("core, directory, transport/access.h, ctxcalls.h, job.h",
              ["core/", "directory/", "store/"] + JOB_CALLS + ["transport/access.h"]),
    "refit": ("core, directory, transport/wire.h, ctxcalls.h, job.h",
              ["core/", "directory/", "refit/"] + JOB_CALLS + ["transport/wire.h"]),
    "mq": ("core, directory, transport/ctxcalls.h, job.h, linkcalls.h",
           ["core/", "directory/", "mq/"] + JOB_CALLS + ["transport/linkcalls.h"]),
    "control": ("core (control stands apart: no context, link or directory)",
                ["core/", "control/"]),
    "cli": ("everything in src/ (not bench/)",
            ["core/", "transport/", "directory/", "cli/"] + [j + "/" for j in JOBS]),
}

# "layer/file" -> headers that one file may include beyond its layer's row.
FILE_RULES = {
    "directory/client.c": ["transport/linkcalls.h"],
    "directory/client_posted.c": ["transport/linkcalls.h"],
    "directory/server.c": ["transport/linkcalls.h"] + JOB_CALLS,
    "directory/peers.c": ["transport/access.h"],
}

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def allowed(rel, header):
    """None when src/REL may include HEADER, else the rule it breaks."""
    layer = rel.split("/", 1)[0]
    if header == "ferry.h":
        return None
    if layer not in RULES:
        return "%s is in no layer of the table (add its folder to RULES and the table)" % rel
    target = header.split("/", 1)[0] if "/" in header else None
    if target not in LAYERS:
        return ('"%s" is not "ferry.h" or a layer\'s header ("LAYER/NAME.h", from src/)'
                % header)
    what, ok = RULES[layer]
    ok = ok + FILE_RULES.get(rel, [])
    if any(header.startswith(p) if p.endswith("/") else header == p for p in ok):
        return None
    if layer in JOBS and target in JOBS and target != layer:
        return "a job never includes another job's header (%s includes %s)" % (layer, target)
    above = RANK.get(target, 0) > RANK[layer]
    why = "a header from a layer above it" if above else "a header its row does not list"
    return "%s may include %s; %s is %s" % (layer, what, header, why)


def scan(root):
    """Returns one line per forbidden include under ROOT/src."""
    bad = []
    src = os.path.join(root, "src")
    for base, dirs, files in os.walk(src):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith((".c", ".h")):
                continue
            path = os.path.join(base, name)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    why = allowed(rel, m.group(1))
                    if why:
                        bad.append('src/%s:%d: #include "%s": %s' % (rel, n, m.group(1), why))
    return bad


def check(root):
    bad = scan(root)
    for b in bad:
        print(b)
    print("include_layers: %d forbidden include(s) (docs/ARCHITECTURE.md section 1, "
          "tests/lint/include_layers.py RULES)" % len(bad))
    return 1 if bad else 0


# (file, include, a word the complaint must hold); each is planted alone in a clean tree.
FORBIDDEN = [
    ("store/get.c", "mq/mq.h", "another job"),
    ("refit/sender.c", "store/store.h", "another job"),
    ("core/util.c", "transport/transport.h", "above"),
    ("transport/link.c", "directory/directory.h", "above"),
    ("directory/table.c", "transport/linkcalls.h", "directory may include"),
    ("directory/server.c", "store/store.h", "above"),
    ("store/put.c", "transport/transport.h", "does not list"),
    ("mq/mq.c", "transport/access.h", "does not list"),
    ("control/cell.c", "directory/directory.h", "control may include"),
    ("control/cell.c", "transport/job.h", "control may include"),
    ("cli/main.c", "bench/netns.h", "not"),
    ("store/ops.c", "hash.h", "not"),
]
CLEAN = {
    "core/util.c": ["ferry.h", "core/core.h"],
    "transport/link.c": ["core/core.h", "transport/transport.h"],
    "directory/server.c": ["directory/directory.h", "transport/ctxcalls.h",
                           "transport/linkcalls.h"],
    "directory/table.c": ["directory/table.h"],
    "store/get.c": ["store/store.h", "transport/access.h", "directory/peers.h"],
    "store/put.c": ["store/store.h"],
    "store/ops.c": ["store/store.h"],
    "refit/sender.c": ["refit/refit.h", "transport/wire.h", "transport/ctxcalls.h"],
    "mq/mq.c": ["mq/mq.h", "transport/linkcalls.h"],
    "control/cell.c": ["control/cell.h", "core/core.h"],
    "cli/main.c": ["store/store.h", "mq/mq.h", "transport/ucx.h"],
}


def plant(root, extra):
    """Writes the clean tree under ROOT/src, plus EXTRA = (file, include) if given."""
    shutil.rmtree(os.path.join(root, "src"), ignore_errors=True)
    for rel, incs in CLEAN.items():
        if extra and extra[0] == rel:
            incs = incs + [extra[1]]
        path = os.path.join(root, "src", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("/* synthetic */\n#include <stdio.h>\n")
            f.writelines('#include "%s"\n' % i for i in incs)


def self_test():
    fails = 0
    with tempfile.TemporaryDirectory() as root:
        plant(root, None)
        bad = scan(root)
        if bad:
            print("self-test: the clean tree was refused: %s" % bad)
            fails += 1
        for rel, inc, word in FORBIDDEN:
            plant(root, (rel, inc))
            bad = scan(root)
            want = 'src/%s:%d: #include "%s"' % (rel, len(CLEAN[rel]) + 3, inc)
            if len(bad) != 1 or not bad[0].startswith(want) or word not in bad[0]:
                print("self-test: %s including %s: want one complaint '%s ... %s', got %s"
                      % (rel, inc, want, word, bad))
                fails += 1
            else:
                print("self-test: refused as it should: %s" % bad[0])
        # The real entry point fails on a forbidden include too (its exit status).
        plant(root, FORBIDDEN[0][:2])
        if check(root) != 1:
            print("self-test: check() passed a tree with a forbidden include")
            fails += 1
    print("include_layers self-test: %d misjudged case(s) of %d" % (fails, len(FORBIDDEN) + 2))
    return 1 if fails else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--self-test":
        sys.exit(self_test())
    sys.exit(check(sys.argv[1] if len(sys.argv) > 1 else "."))
