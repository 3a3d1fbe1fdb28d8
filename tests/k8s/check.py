#!/usr/bin/env python3
"""Checks the Kubernetes examples docs/OPERATIONS.md links (docs/k8s/*.yaml, issue 36 deliverable
6): each parses (python3-yaml), holds the objects it should, and says what ferry and etcd expect.

ferry-serve.yaml: a Deployment of one replica (Recreate: never two directories for one fleet)
running `ferry serve` listening on ferry's default directory port (FERRY_DIRECTORY's default in
src/core/config.c, 7700) and serving HTTP on the port after it (`ferry serve --help`: 7701), the
fleet token from a Secret (listening beyond loopback needs one), /readyz and /healthz probes on
the HTTP port; a Service whose selector matches the pods and whose ports reach both.
etcd.yaml: a headless Service (publishNotReadyAddresses) named as the StatefulSet's serviceName; a
StatefulSet of three etcd members whose --initial-cluster names each pod (NAME-0..2) at
NAME-i.SERVICE...:2380, listening for clients on 2379 and peers on 2380, with a volume claim for
its data; a PodDisruptionBudget that keeps a quorum.

Then, where kubectl exists, `kubectl apply --dry-run=client --validate=false -f` on each file with
a kubeconfig that points nowhere (offline: it never reaches a cluster). Offline kubectl still
parses the file (a syntax error fails the check); recognising the kinds needs an API server, so
that part is reported as not done, never required (kubectl is no Debian 12 package).

Usage: check.py SOURCE_DIR     check SOURCE_DIR/docs/k8s; exit 1 naming each problem
       check.py --self-test    break copies of the examples one way at a time; exit 1 if the
                               checker misses any (or faults the unbroken ones)"""
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

ETCD_CLIENT, ETCD_PEER = 2379, 2380


def ferry_ports(src):
    """(directory port, HTTP port): FERRY_DIRECTORY's default and the port after it."""
    with open(os.path.join(src, "src/core/config.c")) as f:
        m = re.search(r'"FERRY_DIRECTORY",\s*"ferry://[^":]+:(\d+)"', f.read())
    if not m:
        raise SystemExit("check.py: no FERRY_DIRECTORY default in src/core/config.c")
    port = int(m.group(1))
    return port, port + 1


def by_kind(docs, kind):
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == kind]


def one(docs, kind, problems, where):
    found = by_kind(docs, kind)
    if len(found) != 1:
        problems.append("%s: expected one %s, found %d" % (where, kind, len(found)))
        return None
    return found[0]


def get(d, *path, default=None):
    for p in path:
        if isinstance(d, dict):
            d = d.get(p)
        elif isinstance(d, list) and isinstance(p, int) and p < len(d):
            d = d[p]
        else:
            return default
        if d is None:
            return default
    return d


def container(workload, problems, where):
    cs = get(workload, "spec", "template", "spec", "containers", default=[])
    if len(cs) != 1:
        problems.append("%s: expected one container, found %d" % (where, len(cs)))
        return {}
    if not cs[0].get("image"):
        problems.append("%s: the container has no image" % where)
    return cs[0]


def port_number(c, port):
    """A probe's or Service's port (number or the container's port name) as a number."""
    if isinstance(port, int):
        return port
    for p in c.get("ports", []):
        if p.get("name") == port:
            return p.get("containerPort")
    return None


def flag(argv, name):
    """--name VALUE or --name=VALUE in argv; None when absent."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return str(argv[i + 1])
        if isinstance(a, str) and a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def host_port(value):
    m = re.fullmatch(r"(?:[a-z]+://)?([^/]*):(\d+)", value or "")
    return (m.group(1), int(m.group(2))) if m else (None, None)


def check_labels_match(workload, svc, problems, where):
    labels = get(workload, "spec", "template", "metadata", "labels", default={})
    sel = get(svc, "spec", "selector", default={})
    match = get(workload, "spec", "selector", "matchLabels", default={})
    if not sel or any(labels.get(k) != v for k, v in sel.items()):
        problems.append("%s: the Service's selector %s does not match the pods' labels %s"
                        % (where, sel, labels))
    if not match or any(labels.get(k) != v for k, v in match.items()):
        problems.append("%s: spec.selector %s does not match the pods' labels" % (where, match))


def check_service_ports(svc, c, want, problems, where):
    got = set()
    for p in get(svc, "spec", "ports", default=[]):
        target = port_number(c, p.get("targetPort", p.get("port")))
        if target != p.get("port"):
            problems.append("%s: Service port %s reaches container port %s, not the same number"
                            % (where, p.get("port"), target))
        got.add(target)
    for w in want:
        if w not in got:
            problems.append("%s: the Service does not reach port %d" % (where, w))


def check_ferry(docs, src, problems, where="ferry-serve.yaml"):
    dport, hport = ferry_ports(src)
    dep = one(docs, "Deployment", problems, where)
    svc = one(docs, "Service", problems, where)
    if not dep:
        return
    if get(dep, "spec", "replicas") != 1:
        problems.append("%s: replicas must be 1 (two directories split a fleet)" % where)
    if get(dep, "spec", "strategy", "type") != "Recreate":
        problems.append("%s: strategy must be Recreate (never two directories at once)" % where)
    c = container(dep, problems, where)
    argv = list(c.get("command", [])) + list(c.get("args", []))
    if argv[:2] != ["ferry", "serve"]:
        problems.append("%s: the container must run `ferry serve`, runs %s" % (where, argv[:2]))
    _, lport = host_port(flag(argv, "--listen"))
    if lport != dport:
        problems.append("%s: --listen port %s, ferry's directory port is %d" % (where, lport, dport))
    hhost, hp = host_port(flag(argv, "--http"))
    if hp != hport:
        problems.append("%s: --http port %s, ferry serve's default is %d" % (where, hp, hport))
    if hhost in ("127.0.0.1", "localhost", ""):
        problems.append("%s: --http on loopback: the kubelet's probes cannot reach it" % where)
    cports = {p.get("containerPort") for p in c.get("ports", [])}
    for p in (dport, hport):
        if p not in cports:
            problems.append("%s: no containerPort %d" % (where, p))
    env = {e.get("name"): e for e in c.get("env", [])}
    if not get(env, "FERRY_TOKEN", "valueFrom", "secretKeyRef", "name"):
        problems.append("%s: FERRY_TOKEN must come from a Secret (listening beyond loopback "
                        "needs an explicit token, docs/SECURITY.md)" % where)
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        hg = get(c, probe, "httpGet", default={})
        if hg.get("path") != path or port_number(c, hg.get("port")) != hport:
            problems.append("%s: %s must GET %s on port %d" % (where, probe, path, hport))
    if svc:
        check_labels_match(dep, svc, problems, where)
        check_service_ports(svc, c, (dport, hport), problems, where)


def check_etcd(docs, problems, where="etcd.yaml"):
    sts = one(docs, "StatefulSet", problems, where)
    svc = one(docs, "Service", problems, where)
    pdb = one(docs, "PodDisruptionBudget", problems, where)
    if not sts:
        return
    name, sname = get(sts, "metadata", "name"), get(sts, "spec", "serviceName")
    if get(sts, "spec", "replicas") != 3:
        problems.append("%s: an etcd cluster of 3 members, not %s" % (where, get(sts, "spec",
                                                                               "replicas")))
    c = container(sts, problems, where)
    if "etcd" not in str(c.get("image", "")):
        problems.append("%s: the image %s is not etcd's" % (where, c.get("image")))
    argv = list(c.get("command", [])) + list(c.get("args", []))
    if not argv or not str(argv[0]).endswith("etcd"):
        problems.append("%s: the container must run etcd, runs %s" % (where, argv[:1]))
    if host_port(flag(argv, "--listen-client-urls"))[1] != ETCD_CLIENT:
        problems.append("%s: --listen-client-urls must be on port %d" % (where, ETCD_CLIENT))
    if host_port(flag(argv, "--listen-peer-urls"))[1] != ETCD_PEER:
        problems.append("%s: --listen-peer-urls must be on port %d" % (where, ETCD_PEER))
    members = (flag(argv, "--initial-cluster") or "").split(",")
    want = ["%s-%d" % (name, i) for i in range(3)]
    got = [m.split("=", 1)[0] for m in members]
    if got != want:
        problems.append("%s: --initial-cluster names %s, the pods are %s" % (where, got, want))
    for m in members:
        mname, _, url = m.partition("=")
        host, port = host_port(url)
        if port != ETCD_PEER or not (host or "").startswith("%s.%s." % (mname, sname)):
            problems.append("%s: member %s at %s, expected %s.%s...:%d"
                            % (where, mname, url, mname, sname, ETCD_PEER))
    if flag(argv, "--data-dir") not in [v.get("mountPath") for v in c.get("volumeMounts", [])]:
        problems.append("%s: --data-dir is not a mounted volume" % where)
    if not get(sts, "spec", "volumeClaimTemplates"):
        problems.append("%s: no volumeClaimTemplates: a member would lose its data" % where)
    if svc:
        if get(svc, "metadata", "name") != sname:
            problems.append("%s: the Service is %s, the StatefulSet's serviceName %s"
                            % (where, get(svc, "metadata", "name"), sname))
        if get(svc, "spec", "clusterIP") != "None":
            problems.append("%s: the Service must be headless (clusterIP: None)" % where)
        if get(svc, "spec", "publishNotReadyAddresses") is not True:
            problems.append("%s: publishNotReadyAddresses: true, or the members never find each "
                            "other to form the cluster" % where)
        check_labels_match(sts, svc, problems, where)
        check_service_ports(svc, c, (ETCD_CLIENT, ETCD_PEER), problems, where)
    if pdb and get(pdb, "spec", "minAvailable") != 2:
        problems.append("%s: the PodDisruptionBudget must keep 2 of 3 (the quorum)" % where)


def load(path, problems):
    try:
        with open(path) as f:
            return [d for d in yaml.safe_load_all(f) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        problems.append("%s: %s" % (os.path.basename(path), e))
        return []


def check_dir(src, k8s_dir):
    problems = []
    check_ferry(load(os.path.join(k8s_dir, "ferry-serve.yaml"), problems), src, problems)
    check_etcd(load(os.path.join(k8s_dir, "etcd.yaml"), problems), problems)
    return problems


def kubectl_check(k8s_dir):
    """kubectl's offline view of each file: problems, and lines of what it did."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return [], ["kubectl: not installed, skipped (not required)"]
    problems, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "config")
        with open(cfg, "w") as f:  # a cluster nobody listens at: never a real one
            f.write("apiVersion: v1\nkind: Config\nclusters:\n- name: none\n  cluster: "
                    "{server: 'https://127.0.0.1:1', insecure-skip-tls-verify: true}\n"
                    "users:\n- name: none\n  user: {token: none}\ncontexts:\n- name: none\n"
                    "  context: {cluster: none, user: none}\ncurrent-context: none\n")
        env = dict(os.environ, KUBECONFIG=cfg)
        for name in sorted(os.listdir(k8s_dir)):
            if not name.endswith(".yaml"):
                continue
            try:
                r = subprocess.run([kubectl, "apply", "--dry-run=client", "--validate=false",
                                    "--request-timeout=5s", "-f", os.path.join(k8s_dir, name),
                                    "-o", "name"], env=env, capture_output=True, text=True,
                                   timeout=60)
            except (OSError, subprocess.TimeoutExpired) as e:
                notes.append("kubectl: %s: could not run (%s), skipped" % (name, e))
                continue
            out = r.stdout + r.stderr
            if r.returncode == 0:
                notes.append("kubectl: %s: accepted" % name)
            elif "error parsing" in out or "error converting YAML" in out:
                problems.append("kubectl: %s: %s" % (name, out.strip().splitlines()[-1]))
            elif re.search(r"connection refused|unable to recognize|couldn't get current server|"
                           r"Unable to connect to the server", out):
                notes.append("kubectl: %s: parsed; its kinds not checked offline (kubectl needs "
                             "an API server for that)" % name)
            else:
                problems.append("kubectl: %s: %s" % (name, out.strip()))
    return problems, notes


def self_test(src):
    """Each breakage must be caught, and the examples as they are must pass."""
    k8s = os.path.join(src, "docs/k8s")
    ok = True
    if check_dir(src, k8s):
        print("self-test: the examples themselves fail: %s" % check_dir(src, k8s))
        ok = False
    base_f = load(os.path.join(k8s, "ferry-serve.yaml"), [])
    base_e = load(os.path.join(k8s, "etcd.yaml"), [])

    def ferry_c(docs):
        return by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]

    def etcd_c(docs):
        return by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]

    def sub_arg(c, old, new):
        key = "args" if any(old in str(a) for a in c.get("args", [])) else "command"
        c[key] = [str(a).replace(old, new) for a in c[key]]

    breaks = [
        ("ferry", "two replicas", lambda d: by_kind(d, "Deployment")[0]["spec"].update(replicas=2)),
        ("ferry", "rolling update",
         lambda d: by_kind(d, "Deployment")[0]["spec"].update(strategy={"type": "RollingUpdate"})),
        ("ferry", "wrong listen port", lambda d: sub_arg(ferry_c(d), "0.0.0.0:7700", "0.0.0.0:7800")),
        ("ferry", "http on loopback", lambda d: sub_arg(ferry_c(d), "0.0.0.0:7701", "127.0.0.1:7701")),
        ("ferry", "not ferry serve", lambda d: ferry_c(d).update(command=["ferry", "srv"])),
        ("ferry", "no token", lambda d: ferry_c(d).update(env=[])),
        ("ferry", "probe path", lambda d: ferry_c(d)["livenessProbe"]["httpGet"].update(
            path="/metrics")),
        ("ferry", "service selector", lambda d: by_kind(d, "Service")[0]["spec"].update(
            selector={"app": "other"})),
        ("ferry", "service port", lambda d: by_kind(d, "Service")[0]["spec"]["ports"].pop()),
        ("ferry", "no image", lambda d: ferry_c(d).pop("image")),
        ("ferry", "no Service", lambda d: d.remove(by_kind(d, "Service")[0])),
        ("etcd", "two members", lambda d: by_kind(d, "StatefulSet")[0]["spec"].update(replicas=2)),
        ("etcd", "not headless", lambda d: by_kind(d, "Service")[0]["spec"].pop("clusterIP")),
        ("etcd", "not published early",
         lambda d: by_kind(d, "Service")[0]["spec"].pop("publishNotReadyAddresses")),
        ("etcd", "member misnamed", lambda d: sub_arg(etcd_c(d), "etcd-2=", "etcd-3=")),
        ("etcd", "peer port", lambda d: sub_arg(etcd_c(d), ":2380,etcd-1", ":2390,etcd-1")),
        ("etcd", "client port", lambda d: sub_arg(etcd_c(d), "0.0.0.0:2379", "0.0.0.0:2479")),
        ("etcd", "no volume", lambda d: by_kind(d, "StatefulSet")[0]["spec"].pop(
            "volumeClaimTemplates")),
        ("etcd", "service name", lambda d: by_kind(d, "Service")[0]["metadata"].update(
            name="etcd-x")),
        ("etcd", "no quorum budget", lambda d: by_kind(d, "PodDisruptionBudget")[0]["spec"].update(
            minAvailable=1)),
        ("etcd", "not etcd", lambda d: etcd_c(d).update(image="busybox")),
    ]
    for which, what, breakit in breaks:
        docs = copy.deepcopy(base_f if which == "ferry" else base_e)
        breakit(docs)
        problems = []
        if which == "ferry":
            check_ferry(docs, src, problems)
        else:
            check_etcd(docs, problems)
        if not problems:
            print("self-test: %s example with %s passed the check" % (which, what))
            ok = False
    with tempfile.TemporaryDirectory() as tmp:  # a file that does not parse
        shutil.copytree(k8s, os.path.join(tmp, "k8s"))
        with open(os.path.join(tmp, "k8s", "etcd.yaml"), "a") as f:
            f.write("\n  bad: [indent\n")
        if not any("etcd.yaml" in p for p in check_dir(src, os.path.join(tmp, "k8s"))):
            print("self-test: a malformed etcd.yaml passed the check")
            ok = False
        if shutil.which("kubectl") and not any(
                "etcd.yaml" in p for p in kubectl_check(os.path.join(tmp, "k8s"))[0]):
            print("self-test: kubectl's check let a malformed etcd.yaml pass")
            ok = False
    print("self-test: %d breakages caught" % len(breaks) if ok else "self-test: FAILED")
    return ok


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return 0 if self_test(src) else 1
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    src = sys.argv[1]
    k8s = os.path.join(src, "docs/k8s")
    problems = check_dir(src, k8s)
    kproblems, notes = kubectl_check(k8s)
    for n in notes:
        print(n)
    for p in problems + kproblems:
        print("FAIL " + p)
    if not problems + kproblems:
        print("docs/k8s: ferry-serve.yaml and etcd.yaml check out")
    return 1 if problems + kproblems else 0


if __name__ == "__main__":
    sys.exit(main())
