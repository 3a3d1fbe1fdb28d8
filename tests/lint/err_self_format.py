#!/usr/bin/env python3
"""Fails when a call in src/ formats the thread's error detail into itself:
fr_err(rc, "...: %s", ..., ferry_last_error()) (or fr_err_errno) reads the buffer it writes.
fr_err copies its format's output before it escapes it into the detail, so the pattern no longer
garbles a message, but it says "what: why" by hand where fr_err_wrap(rc, "what") is the rule
(docs/CODESTYLE.md), and gcc's -Wrestrict does not see through the varargs to catch it.
Usage: err_self_format.py SOURCE_DIR"""
import os
import re
import sys

CALL = re.compile(r"\bfr_err(?:_errno)?\s*\(")


def calls(text):
    """Yields (offset, argument text) of every fr_err/fr_err_errno call in text."""
    for m in CALL.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == '"':  # skip a string literal
                i += 1
                while i < len(text) and text[i] != '"':
                    i += 2 if text[i] == "\\" else 1
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            i += 1
        yield m.start(), text[m.end():i - 1]


def main(root):
    bad = []
    for base, _, files in os.walk(os.path.join(root, "src")):
        for name in sorted(files):
            if not name.endswith(".c"):
                continue
            path = os.path.join(base, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            for at, args in calls(text):
                if "ferry_last_error" in args:
                    line = text.count("\n", 0, at) + 1
                    bad.append("%s:%d" % (os.path.relpath(path, root), line))
    for b in bad:
        print("%s: fr_err formats ferry_last_error() into itself; use fr_err_wrap" % b)
    print("err_self_format: %d call(s) of the pattern" % len(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
