"""ferry.RefitSender and ferry.RefitReceiver: push each weight version of a model from the trainer
to every inference engine (ferry_refit_*, docs/REFIT.md).

    # trainer                                      # each engine
    tx = ferry.RefitSender("policy", model.state_dict())
                                                   rx = ferry.RefitReceiver("policy")
                                                   rx.bind(model.state_dict())   # in place
    optimizer.step()
    tx.push(1)                                     rx.wait(1)

The sender declares every tensor of the state dict once (where its bytes live: the tensors
themselves, no copy) and seals the plan; push(version) sends their current bytes. A receiver
binds its own tensors (bytes land in them) or takes views into one flat ferry buffer
(tensors()); either way nothing is copied again on the Python side.

Finding the sender by name, as C senders and receivers do (ferry_refit_opts.publish): when a
directory is configured (FERRY_DIRECTORY set, or RefitSender(directory=URL)), RefitSender(name)
publishes the record "ferry:job/refit/NAME" on its context's node there (under the node's lease), and
RefitReceiver(name) on any host whose FERRY_DIRECTORY names the same directory looks it up. So
a Python receiver finds a C sender and a C receiver (ferry_refit_receiver_open(ctx, "NAME"))
finds a Python sender. With no directory configured the C side publishes nothing (its
FERRY_DIRECTORY default, ferry://127.0.0.1:7700, must then be running); Python instead falls
back to a file on this host: FERRY_CTL_DIR/ferry-refit-NAME (mode 0600, removed on close) holds
the address and RefitReceiver(name) on the same host reads it. That directory is shared with
other users (/dev/shm): the file is written under a fresh unguessable name and renamed into
place, and only a regular file this user owns is read; a link, a FIFO or another user's file
under the name is refused (ferry.AccessDenied, saying what is there), never followed or waited
on. That fallback is for one host and Python only; across hosts, or with C peers, configure a
directory (`ferry serve`), or pass the sender's `address` to the receiver instead of the name.

Routes and alias mode (docs/REFIT.md): push(v, route="direct" | "chain" | "auto") as
ferry_refit_push_opts.route (auto, the default: receivers on the sender's host read from it
directly, the others chain). RefitSender(alias=True) keeps the whole wire layout in one shared
buffer, and a receiver on its host calls bind_alias() (or opens with alias=True) for read-only
views into it: nothing is copied, and the engine must not read them while a push is under way.

Loading while buckets land: for name, t in rx.updates(v) (engine.load_weights(rx.updates(v)))
yields every tensor of version v once the buckets that carry it landed and verified, as views,
with an optional trainer -> engine name mapping that also fuses (ferry/refit/load.py).

asyncio: await tx.push_async(v, ...) runs the push in the loop's default executor (as
ferry.aio does); await rx.wait_async(v, timeout=...) holds no thread at all: the receiver's
commit callback wakes it, so cancelling it leaves nothing behind.

Sharded senders (docs/REFIT.md, Sharded senders): the M ranks of a trainer that hold one model
together each open RefitSender(name, local_state_dict, rank=r, world=M, pieces={local name:
Piece(global name, dim, start, stop)}) and all push every version; RefitReceiver(name) sees one
model and reads each rank's part straight from that rank. tp_pieces, fsdp_pieces and
expert_pieces build the pieces of Megatron TP, FSDP and expert-parallel ranks.

The package, by thing: sender.py (RefitSender), receiver.py (RefitReceiver), shards.py (Piece,
tp_shards), pieces.py (the senders' piece builders), load.py (updates()), events.py (the
receivers' bucket and commit callbacks), names.py (the same-host rendezvous file and node names).
"""
from .._lib import lib  # noqa: F401 (ferry.refit.lib, as before the split)
from .events import _listeners  # noqa: F401 (tests look into it)
from .names import _open_shared, refit_address
from .receiver import RefitReceiver
from .sender import ROUTES, RefitOpts, PushOpts, RefitSender  # noqa: F401
from .shards import Piece, tp_shards
from .pieces import expert_pieces, fsdp_pieces, tp_pieces
from . import events, load, names, pieces, receiver, sender, shards  # noqa: F401

__all__ = ["RefitSender", "RefitReceiver", "refit_address", "ROUTES", "Piece", "tp_shards",
           "tp_pieces", "fsdp_pieces", "expert_pieces"]
