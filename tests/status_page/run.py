#!/usr/bin/python3
"""The fleet status page in a real browser (headless Chromium), run by ctest (make test).

It starts a small fleet on loopback: a `ferry serve` that hosts the directory ("hub"), a second
one that joins it ("shelf"), store keys under two prefixes (`ferry put`), and a child process
(this file with --fleet, through the Python binding) holding a refit sender published in the
directory whose receiver committed version 7, an mq topic with a publisher and a subscriber that
has three messages queued, and a control cell. Then it loads hub's / in Chromium with
--dump-dom and checks the tables the page's script built from /v1/fleet: the page's HTML has no
data in it, so every value found was fetched and rendered by the script. A key whose name is
HTML checks that names are shown as text. It saves a screenshot (argv[1]) as an artefact.

Then it stops "shelf" (SIGSTOP: its records stay listed until its lease lapses) and checks that
/v1/fleet still answers within a bound of its budget (limits.budget_ms: a call honouring its
timeout, generously bounded, not a performance figure), lists shelf unreachable, skips it on the
next snapshot, and that /healthz and /metrics answer while a snapshot is in flight.

Usage: run.py SCREENSHOT.png   (env: FERRY_CLI, FERRY_LIB, FERRY_SOURCE_DIR)
"""
import html.parser
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

CLI = os.environ.get("FERRY_CLI", "ferry")
SRC = os.environ.get("FERRY_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
HOSTILE = "<img src=x onerror=document.title='owned'>"  # a key prefix that is HTML
COMMITTED = 7
QUEUED = 3


def fleet_child():
    """The jobs beyond the store: runs until its stdin closes."""
    sys.path.insert(0, os.path.join(SRC, "python"))
    import ctypes
    import numpy as np
    import ferry
    from ferry import _lib
    from ferry.refit import RefitOpts
    lib = _lib.lib

    tx = ferry.Context(name="trainer")
    opts = RefitOpts(ctypes.sizeof(RefitOpts), 0, 0, 1, None)  # publish in FERRY_DIRECTORY
    sender = ctypes.c_void_p()
    ferry.check(lib.ferry_refit_sender_open(tx.handle, b"policy", ctypes.byref(opts),
                                            ctypes.byref(sender)))
    weights = np.arange(1024, dtype=np.float32)
    desc = _lib.TensorDesc(12, 1)  # FERRY_DTYPE_F32
    desc.shape[0] = weights.size
    ferry.check(lib.ferry_refit_declare(sender, b"w", ctypes.byref(desc), weights.ctypes.data, 0))
    ferry.check(lib.ferry_refit_seal(sender))
    rx = ferry.RefitReceiver(tx.address, ctx=ferry.Context(name="engine-0"))
    views = rx.tensors(like="numpy")
    ferry.check(lib.ferry_refit_push(sender, COMMITTED, None))
    assert rx.wait(COMMITTED) is not None

    pub = ferry.MQ(name="learner")
    sub = ferry.MQ(name="actor-0")
    sub.subscribe("rollouts.done")
    pub.wait_subscribers("rollouts.done", 1)
    for i in range(QUEUED):
        pub.publish("rollouts.done", b"episode %d" % i)
    cell = ferry.ControlCell("engine-a", 1)
    rank = ferry.ControlRank("engine-a", 0)
    print("ready", flush=True)
    sys.stdin.read()
    for h in (rank, cell, sub, pub, rx):
        h.close()
    lib.ferry_refit_sender_close(sender)


def fail(msg):
    print("status_page: FAILED: " + msg, file=sys.stderr)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args, env, log):
    p = subprocess.Popen([CLI, "serve", "--json"] + args, env=env, stdout=subprocess.PIPE,
                         stderr=log, text=True)
    line = p.stdout.readline()
    if not line:
        fail("ferry serve %s did not start (see %s)" % (" ".join(args), log.name))
    return p, json.loads(line)


def tables(dom):
    """{table id: [[cell text, ...], ...]} of every table in the dumped DOM."""
    class P(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.out, self.table, self.row, self.cell = {}, None, None, None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "table":
                self.table = self.out.setdefault(a.get("id"), [])
            elif tag == "tr" and self.table is not None:
                self.row = []
                self.table.append(self.row)
            elif tag in ("td", "th") and self.row is not None:
                self.cell = ""
            elif tag == "img":
                self.out.setdefault("<img>", []).append(a)

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None:
                self.row.append(self.cell)
                self.cell = None
            elif tag == "table":
                self.table = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data
    p = P()
    p.feed(dom)
    return p.out


def row(table, first, name):
    for r in table:
        if r and r[0] == first:
            return r
    fail("the %s table has no row for %r: %r" % (name, first, table))


def check_page(dom):
    t = tables(dom)
    status = re.search(r'<div id="status"[^>]*>([^<]*)</div>', dom)
    if not status or not status.group(1).startswith("live"):
        fail("the page says %r, not live" % (status.group(1) if status else dom[:2000]))
    nodes = {r[0]: r for r in t.get("nodes", [])[1:]}
    # one node per process and directory, named as its context, showing its jobs
    for n, job in (("hub", "store"), ("shelf", "store"), ("trainer", "refit"),
                   ("learner", "mq"), ("actor-0", "mq")):
        if n not in nodes or job not in nodes[n][1]:
            fail("node %s (a %s) is not on the page: %r" % (n, job, nodes))
    ckpt = row(t["store"], "ckpt/", "store")
    if ckpt[1] != "2" or not ckpt[2].startswith("5096 B"):
        fail("ckpt/ shows %r, not 2 keys of 5096 bytes" % ckpt)
    roll = row(t["store"], "rollouts/", "store")
    if roll[1] != "1" or not roll[2].startswith("2048 B"):
        fail("rollouts/ shows %r, not 1 key of 2048 bytes" % roll)
    hostile = row(t["store"], HOSTILE + "/", "store")
    if t.get("<img>"):
        fail("a key's name became HTML: %r (row %r)" % (t["<img>"], hostile))
    policy = row(t["refit"], "policy", "refit")
    if policy[1] != str(COMMITTED) or policy[4] != "engine-0" or policy[5] != str(COMMITTED):
        fail("refit row %r: not version %d committed by engine-0" % (policy, COMMITTED))
    topic = row(t["mq"], "rollouts.done", "mq")
    if topic[1] != "learner" or topic[2] != "actor-0" or topic[3] != str(QUEUED):
        fail("mq row %r: not learner -> actor-0 with %d queued" % (topic, QUEUED))
    cell = row(t["control"], "engine-a", "control")
    if cell[1] != "serving" or cell[5] != "1":
        fail("control row %r: not a serving cell of 1 rank" % cell)


def wait_fleet(base, deadline):
    """/v1/fleet once the child's jobs are all in it (the directory learns of them as they
    register): a bounded wait for a state, not a timing."""
    last = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(base + "/v1/fleet", timeout=30) as r:
            last = json.load(r)
        refit = [s for s in last["refit"] if s["sender"] == "policy"]
        mq = [t for t in last["mq"] if t["topic"] == "rollouts.done"]
        if (refit and refit[0]["receivers"] and mq and mq[0]["depth"] == QUEUED and
                last["control"]["cells"]):
            return last
        time.sleep(0.2)
    fail("the fleet never showed every job: %s" % json.dumps(last)[:2000])


def get(url, timeout=60):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def timed_fleet(base):
    """/v1/fleet and how long it took (seconds)."""
    t0 = time.monotonic()
    _, body = get(base + "/v1/fleet")
    return json.loads(body), time.monotonic() - t0


def shelf_of(fleet):
    nodes = [n for n in fleet["nodes"] if n["name"] == "shelf"]
    if not nodes:
        fail("shelf is not listed: %s" % json.dumps(fleet)[:2000])
    return nodes[0]


def check_stopped_node(base, shelf):
    """shelf is stopped: a snapshot in flight waits on it for at most the budget."""
    fleet, _ = timed_fleet(base)
    budget, cache = fleet["limits"]["budget_ms"] / 1000, fleet["limits"]["cache_ms"] / 1000
    bound = 3 * budget + 2  # a generous bound on the budget being honoured
    shelf.send_signal(signal.SIGSTOP)
    time.sleep(cache + 0.1)  # past the cached snapshot: the next one asks shelf
    out = {}

    def fetch():
        out["fleet"], out["took"] = timed_fleet(base)
    t = threading.Thread(target=fetch)
    t.start()
    during = 0
    while t.is_alive():
        for path in ("/healthz", "/metrics"):
            status, _ = get(base + path, timeout=bound)
            if status != 200:
                fail("%s answered %d while a snapshot was in flight" % (path, status))
        during += t.is_alive()
        time.sleep(0.05)
    t.join()
    if not during:
        fail("no /healthz answered while the snapshot was in flight (it took %.1f s)" % out["took"])
    if out["took"] > bound:
        fail("/v1/fleet took %.1f s with a stopped node: over %.1f s (budget %.1f s)" %
             (out["took"], bound, budget))
    node = shelf_of(out["fleet"])
    if node["reached"] or not node.get("error") or not node.get("unreachable_since"):
        fail("the stopped shelf is not marked unreachable: %r" % node)
    others = [n for n in out["fleet"]["nodes"] if n["name"] != "shelf" and not n["reached"]]
    if others:
        fail("nodes other than the stopped one were not reached: %r" % others)
    time.sleep(cache + 0.1)
    again, took = timed_fleet(base)
    node2 = shelf_of(again)
    if (node2["reached"] or not node2.get("skipped") or
            node2.get("unreachable_since") != node["unreachable_since"]):
        fail("the next snapshot did not skip shelf, unreachable since %r: %r" %
             (node["unreachable_since"], node2))
    if took > bound:
        fail("/v1/fleet took %.1f s skipping the stopped node: over %.1f s" % (took, bound))
    print("status_page: stopped shelf: %.2f s (budget %.1f s), %d health checks meanwhile, then "
          "%.2f s skipping it: %s" % (out["took"], budget, during, took, node["error"]))


def chromium(args, profile, timeout=120):
    cmd = [shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-dev-shm-usage", "--no-first-run", "--user-data-dir=" + profile] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--fleet":
        return fleet_child()
    if len(sys.argv) != 2:
        fail("usage: run.py SCREENSHOT.png")
    if not shutil.which("chromium"):
        fail("chromium is not installed (scripts/deps.sh test installs it)")
    shot = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="ferry-status-")
    env = dict(os.environ, FERRY_DIRECTORY="ferry://127.0.0.1:%d" % free_port(),
               FERRY_CTL_DIR=os.path.join(tmp, "ctl"), FERRY_METRICS_LISTEN="")
    os.mkdir(env["FERRY_CTL_DIR"])
    log = open(os.path.join(tmp, "fleet.log"), "w")
    procs = []
    try:
        hub, ready = serve(["--name", "hub", "--http", "127.0.0.1:0"], env, log)
        procs.append(hub)
        base = ready["status"].rstrip("/")
        shelf, _ = serve(["--name", "shelf", "--directory", env["FERRY_DIRECTORY"]], env, log)
        procs.append(shelf)
        for key, size in (("ckpt/step-1/w", 4096), ("ckpt/step-1/b", 1000),
                          ("rollouts/r1", 2048), (HOSTILE + "/k", 16)):
            path = os.path.join(tmp, "blob")
            with open(path, "wb") as f:
                f.write(os.urandom(size))
            subprocess.run([CLI, "put", key, path], env=env, check=True, stderr=log)
        child = subprocess.Popen([sys.executable, __file__, "--fleet"], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                 text=True)
        procs.append(child)
        if child.stdout.readline().strip() != "ready":
            fail("the fleet child did not start (see %s)" % log.name)
        wait_fleet(base, time.monotonic() + 60)

        profile = os.path.join(tmp, "chromium")
        r = chromium(["--virtual-time-budget=5000", "--dump-dom", base + "/"], profile)
        if r.returncode != 0 or "<table" not in r.stdout:
            fail("chromium --dump-dom exit %d: %s" % (r.returncode, r.stderr[-2000:]))
        check_page(r.stdout)
        r = chromium(["--virtual-time-budget=5000", "--window-size=1400,1500",
                      "--screenshot=" + shot, base + "/"], profile)
        with open(shot, "rb") as f:
            if r.returncode != 0 or f.read(8) != b"\x89PNG\r\n\x1a\n":
                fail("no screenshot (chromium exit %d): %s" % (r.returncode, r.stderr[-2000:]))
        check_stopped_node(base, shelf)
        print("status_page: ok: the page rendered the fleet; screenshot %s; a stopped node was "
              "marked unreachable within the budget" % shot)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # shelf, stopped: it must see its SIGTERM
        for p in reversed(procs):
            if p.stdin:  # the child: it ends when its stdin does
                p.stdin.close()
            else:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
