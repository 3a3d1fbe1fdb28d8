#!/usr/bin/env python3
# Device probe (issue 37, docs/GPU.md): times a 1 GiB device-to-device copy in a second process
# from its own memory and from the first process's memory through CUDA IPC, with the first process
# idle and then copying on the same GPU: whether IPC copies, or two processes sharing the GPU,
# make the colocated refit slower than one copy. Needs torch with CUDA. Usage: python3 scripts/gpu-ipc-probe.py
import time, torch, torch.multiprocessing as mp
N = 1 << 30
def med(f, n=10):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); f(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3
def child(q, r, go, stop):
    src = q.get()
    own = torch.empty(N, dtype=torch.uint8, device="cuda"); own.fill_(3)
    dst = torch.empty(N, dtype=torch.uint8, device="cuda")
    r.put(("child own->own 1GiB ms", med(lambda: dst.copy_(own))))
    r.put(("child ipc->own 1GiB ms, parent idle", med(lambda: dst.copy_(src))))
    go.set(); time.sleep(0.3)
    r.put(("child own->own 1GiB ms, parent copying", med(lambda: dst.copy_(own))))
    r.put(("child ipc->own 1GiB ms, parent copying", med(lambda: dst.copy_(src))))
    stop.set(); r.put(None)
if __name__ == "__main__":
    mp.set_start_method("spawn")
    a = torch.empty(N, dtype=torch.uint8, device="cuda"); a.fill_(1)
    b = torch.empty(N, dtype=torch.uint8, device="cuda")
    print("parent own->own 1GiB ms", med(lambda: b.copy_(a)))
    q, r, go, stop = mp.Queue(), mp.Queue(), mp.Event(), mp.Event()
    p = mp.Process(target=child, args=(q, r, go, stop)); p.start(); q.put(a)
    go.wait(60)
    while not stop.is_set():
        b.copy_(a); torch.cuda.synchronize()
    while (x := r.get(timeout=60)) is not None:
        print(*x)
    p.join(30)
