"""Every C struct the binding mirrors (each ctypes.Structure of the ferry package, which names its
C type in _c_name_) has the layout C gives it: the same sizeof, and each field the same offsetof
and size. A C program generated from the Python declarations is compiled against include/ferry.h
with the system's cc and prints what C says; a field misplaced, resized or named differently in
Python fails here (a name C does not know fails the compile, naming it), not as corrupted memory
at run time (issue 33 deliverable 6)."""
import ctypes
import os
import shutil
import subprocess

import pytest

import ferry
from ferry import _lib

INCLUDE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "include")


def mirrored():
    """Every ctypes.Structure subclass defined in the ferry package, by C name."""
    out, todo = {}, list(ctypes.Structure.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.split(".")[0] != ferry.__name__:
            continue
        assert getattr(cls, "_c_name_", None), \
            "%s.%s mirrors a C struct but names no _c_name_" % (cls.__module__, cls.__qualname__)
        out[cls._c_name_] = cls
    return out


def c_program(structs):
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "ferry.h"',
             "int main(void) {"]
    for cname, cls in sorted(structs.items()):
        lines.append('  printf("%s %%zu\\n", sizeof(%s));' % (cname, cname))
        for f in cls._fields_:
            lines.append('  printf("%s.%s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));'
                         % (cname, f[0], cname, f[0], cname, f[0]))
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    """{C name: size, "C name.field": (offset, size)} as the C compiler lays them out."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (cc) to check the struct layouts with"
    assert os.path.exists(os.path.join(INCLUDE, "ferry.h")), INCLUDE
    d = tmp_path_factory.mktemp("layout")
    src, exe = d / "layout.c", d / "layout"
    src.write_text(c_program(mirrored()))
    out = subprocess.run([cc, "-std=gnu17", "-I", INCLUDE, "-o", str(exe), str(src)],
                         capture_output=True, text=True)
    assert out.returncode == 0, "the layout program does not compile (a field C does not " \
        "know?):\n%s" % out.stderr[-3000:]
    got = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True,
                               check=True).stdout.splitlines():
        name, *nums = line.split()
        got[name] = tuple(int(n) for n in nums) if len(nums) > 1 else int(nums[0])
    return got


def mismatches(cls, c):
    """What differs between cls's ctypes layout and C's (c from c_layout), one line each."""
    bad, cname = [], cls._c_name_
    if ctypes.sizeof(cls) != c[cname]:
        bad.append("sizeof(%s): C %d, Python %d" % (cname, c[cname], ctypes.sizeof(cls)))
    for f in cls._fields_:
        field = getattr(cls, f[0])
        want = c.get("%s.%s" % (cname, f[0]))
        if want != (field.offset, field.size):
            bad.append("%s.%s: C (offset, size) %s, Python %s"
                       % (cname, f[0], want, (field.offset, field.size)))
    return bad


def test_every_struct_is_checked():
    names = set(mirrored())
    # the ones the binding passes to C today; a new one is found by mirrored() on its own
    assert {"ferry_tensor_desc", "ferry_ctx_opts", "ferry_store_opts", "ferry_store_info",
            "ferry_store_item", "ferry_cuda_info", "ferry_refit_opts", "ferry_refit_push_opts",
            "ferry_refit_piece", "ferry_mq_opts", "ferry_mq_msg", "ferry_ctl_cell_opts",
            "ferry_ctl_rank_opts", "ferry_ctl_command", "ferry_ctl_status",
            "ferry_ctl_rank_status", "ferry_stat"} <= names, names


def test_layouts_match_c(c_layout):
    bad = [line for cls in mirrored().values() for line in mismatches(cls, c_layout)]
    assert not bad, "ctypes structs that do not match ferry.h:\n" + "\n".join(bad)


def test_a_misplaced_field_is_caught(c_layout):
    """The check itself: StoreOpts with two fields swapped, and with one the wrong width, each
    differ from C, naming the field."""
    fields = list(_lib.StoreOpts._fields_)
    swapped = fields[:2] + [fields[3], fields[2]] + fields[4:]  # lease_ms before capacity
    wide = [(n, ctypes.c_uint64 if n == "lease_ms" else t) for n, t in fields]
    for layout in (swapped, wide):
        bad = mismatches(type("Bad", (ctypes.Structure,),
                              {"_c_name_": "ferry_store_opts", "_fields_": layout}), c_layout)
        assert any("ferry_store_opts.lease_ms" in b for b in bad), bad
