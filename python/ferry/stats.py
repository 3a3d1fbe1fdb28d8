"""Metrics of a ferry node: ferry.stats() and ferry.prometheus() read what libferry counts
(ferry_stats_each, ferry_stats_prometheus); docs/OPERATIONS.md lists every metric.

    s = ferry.Store(host_directory=True)
    s.put("k", array)
    for m in ferry.stats(s):          # a Context, or anything opened on one (Store, MQ, RefitSender)
        print(m["name"], m["labels"], m["value"])
"""
import ctypes
from ctypes import c_size_t, c_void_p
from typing import Any, Dict, List, Optional

from . import _lib
from ._lib import lib
from .errors import check

__all__ = ["stats", "prometheus", "readiness"]

KINDS = {0: "counter", 1: "gauge", 2: "histogram"}


_STAT_FN = _lib.STAT_FN  # ferry_stats_fn, over _lib.Stat (declared, with the prototypes, in _lib)


def _handle(of: Any) -> Optional[int]:
    """The ferry_ctx behind `of`: None (the process's metrics only: control), a Context, or an
    object opened on one (Store, MQ, RefitSender: their `_ctx`)."""
    if of is None:
        return None
    ctx = getattr(of, "_ctx", of)
    return ctx.handle


def stats(of: Any = None) -> List[Dict[str, Any]]:
    """Every sample, as dicts: name, help, kind ("counter", "gauge", "histogram"), labels (a
    dict; node is the ctx's name), value (for a histogram the sum), and for histograms count and
    buckets (a list of (upper bound, cumulative count), +Inf last). Base units: seconds, bytes."""
    out: List[Dict[str, Any]] = []

    def each(p: Any, _arg: Any) -> int:
        try:
            s = p.contents
            m = {"name": s.name.decode(), "help": s.help.decode(), "kind": KINDS[s.kind],
                 "labels": {s.label_names[i].decode(): s.label_values[i].decode()
                            for i in range(s.nlabels)},
                 "value": s.value}
            if s.kind == 2:
                m["count"] = s.count
                m["buckets"] = [(s.bucket_le[i], s.bucket_counts[i]) for i in range(s.nbuckets)]
                m["buckets"].append((float("inf"), s.count))
            out.append(m)
            return 0
        except Exception:  # must not escape into C
            return 1

    cb = _STAT_FN(each)
    check(lib.ferry_stats_each(_handle(of), cb, None))
    return out


def prometheus(of: Any = None) -> str:
    """The same samples in the Prometheus text format (what /metrics serves)."""
    text, n = c_void_p(), c_size_t()
    check(lib.ferry_stats_prometheus(_handle(of), ctypes.byref(text), ctypes.byref(n)))
    try:
        return ctypes.string_at(text, n.value).decode()
    finally:
        lib.ferry_stats_text_free(text)


def readiness(of: Any = None) -> str:
    """"ready" when every directory lease of the ctx's jobs is held (what /readyz says); raises
    the ferry error with the reason otherwise."""
    why = ctypes.create_string_buffer(512)
    check(lib.ferry_stats_ready(_handle(of), why, len(why)))
    return why.value.decode()
