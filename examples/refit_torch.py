#!/usr/bin/env python3
"""Refit a torch model: the trainer pushes its state_dict to two inference processes, which run
the model and must match the trainer's output exactly, version after version.

    python3 examples/refit_torch.py [--versions 3 --hidden 256]

The trainer declares its model's tensors to a ferry.RefitSender once (their memory in place, no
copy); each receiver binds its own model's state_dict, so a push writes straight into the
receiver's parameters. Between versions the trainer takes an optimizer step, which updates its
parameters in place, and pushes again. A bfloat16 buffer rides along.
"""
import argparse
import os
import subprocess
import sys

import torch

try:
    import ferry
except ImportError:  # run from a checkout: use its python/ folder
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import ferry


class Policy(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.inp = torch.nn.Linear(32, hidden)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 10)
        self.register_buffer("temperature", torch.ones(10, dtype=torch.bfloat16))

    def forward(self, x):
        x = torch.relu(self.inp(x))
        x = torch.relu(self.mid(x))
        return self.out(x) / self.temperature.float()


def probe():
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(1234))


def receiver(args):
    torch.set_num_threads(1)
    torch.manual_seed(os.getpid())  # different initial weights than the trainer's
    model = Policy(args.hidden).eval()
    with ferry.RefitReceiver(args.name, timeout=30) as rx:
        rx.bind(model.state_dict())  # bytes land in the parameters themselves
        print("attached", flush=True)
        for line in sys.stdin:
            # wait raises (Timeout, PeerGone) rather than return while the parameters hold torn
            # bytes: part of a newer version over the last one (a failed push, a dead sender)
            v = rx.wait(int(line), timeout=30)
            with torch.no_grad():
                y = model(probe())
            if rx.committed != v:  # a push began landing while the model ran: not version v
                raise SystemExit("refit_torch: weights changed under the forward pass; not "
                                 "serving them")
            print(v, y.numpy().tobytes().hex(), flush=True)


def trainer(args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Policy(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    name = "refit-torch-example-%d" % os.getpid()
    with ferry.RefitSender(name, model.state_dict()) as tx:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "receiver", "--name", name,
               "--hidden", str(args.hidden)]
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(ferry.__file__)))
        kids = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=env) for _ in range(2)]
        try:
            for k in kids:
                if k.stdout.readline().strip() != "attached":
                    raise SystemExit("refit_torch: a receiver did not attach")
            tx.wait_receivers(2, timeout=30)
            for v in range(1, args.versions + 1):
                if v > 1:  # a training step: parameters change in place
                    loss = model(torch.randn(16, 32)).pow(2).mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    model.temperature.fill_(1.0 + v / 8)  # bfloat16 buffer changes too
                tx.push(v, timeout=30)
                with torch.no_grad():
                    want = model(probe()).numpy().tobytes().hex()
                for k in kids:
                    k.stdin.write("%d\n" % v)
                    k.stdin.flush()
                for i, k in enumerate(kids):
                    got = k.stdout.readline().split()
                    if got != [str(v), want]:
                        raise SystemExit("refit_torch: receiver %d's output differs at version "
                                         "%d" % (i, v))
            nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            print("refit_torch: %d versions of a %d-tensor model (%.1f KiB) pushed to 2 "
                  "receivers; their outputs match the trainer's exactly"
                  % (args.versions, len(model.state_dict()), nbytes / 1024))
        finally:
            for k in kids:
                k.stdin.close()
            for k in kids:
                try:
                    k.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    k.kill()
                    k.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=("trainer", "receiver"), default="trainer")
    p.add_argument("--name")
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    (receiver if args.role == "receiver" else trainer)(args)


if __name__ == "__main__":
    main()
