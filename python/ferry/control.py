"""ferry.Control, ferry.ControlRank and ferry.ControlCell: an inference engine's weight lifecycle
(serving -> clearing -> cleared -> updating -> serving), agreed through a shared-memory cell
(ferry_ctl_*, docs/CONTROL.md).

    # the engine (once)             # each rank                     # the RL controller
    cell = ferry.ControlCell("llm-0", nranks=2)
                                    r = ferry.ControlRank("llm-0", rank)
                                    while True:                     c = ferry.Control("llm-0")
                                        r.step(clear=drop_weights,  c.request("clear", 30)
                                               update=load_weights) c.request("update", 300)

Requests block (the GIL released) until every rank acked; a rank that failed, a dead rank, a
refused transition or a race with another controller raise ferry.Error subclasses. A request
needs every rank attached: c.wait_ranks() waits for them after the ranks' threads or processes
start. A cell still open when the interpreter exits is closed (its file removed) at exit, before
daemon threads stop, so a clean exit leaves nothing in FERRY_CTL_DIR.
"""
import atexit
import collections
import ctypes
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Union

from . import _lib
from ._lib import Closing, byref, c_int, c_uint32, c_uint64, c_void_p, lib
from .errors import Error, InvalidArgument, Timeout, check

__all__ = ["Control", "ControlRank", "ControlCell", "Command", "STATES", "COMMANDS"]

STATES = {0: "absent", 1: "serving", 2: "clearing", 3: "cleared", 4: "updating", 5: "failed"}
COMMANDS = {0: "none", 1: "clear", 2: "update", 3: "abort"}
_STATE_CODE = {v: k for k, v in STATES.items()}
_CMD_CODE = {v: k for k, v in COMMANDS.items()}
MESSAGE_MAX = 32

Command = collections.namedtuple("Command", "seq cmd")
Command.__doc__ = "A command a rank took: seq (increasing per cell) and cmd (\"clear\", ...)."


# The C structs this module passes (declared, with every prototype, in _lib)
CellOpts, RankOpts, CtlCommand = _lib.CtlCellOpts, _lib.CtlRankOpts, _lib.CtlCommand
CtlStatus, CtlRankStatus = _lib.CtlStatus, _lib.CtlRankStatus


_ms = _lib.timeout_ms


def _name(name: str) -> bytes:
    if not isinstance(name, str):
        raise TypeError("ferry: a cell name is a str, not %s" % type(name).__name__)
    return _lib.encoded(name, "name")


def _state_code(state: Union[str, int]) -> int:
    if isinstance(state, int):
        return _lib.c_int_of(state, c_int, "state")
    try:
        return _STATE_CODE[state]
    except KeyError:
        raise InvalidArgument(-1, "no state %r (one of %s)" % (state, ", ".join(
            s for s in _STATE_CODE if s != "absent"))) from None


class _Handle(Closing):
    """A control handle (cell, rank, controller): `handle`, close(), `with` closes it."""

    _close_fn: Optional[Callable[[Any], None]] = None

    def __init__(self) -> None:
        self._h = None
        self._lock = threading.Lock()

    @property
    def handle(self) -> int:
        """The C handle (ValueError once closed)."""
        if not self._h:
            raise ValueError("ferry: %s is closed" % type(self).__name__)
        return self._h

    def close(self) -> None:
        """Closes the handle. Idempotent."""
        with self._lock:
            h, self._h = self._h, None
        if h:
            type(self)._close_fn(h)


# The cells this process created and has not closed: closed at exit (below).
_open_cells: "weakref.WeakSet[ControlCell]" = weakref.WeakSet()


@atexit.register
def _close_cells() -> None:
    # atexit runs before the interpreter finalizes, while daemon threads (a rank's loop) still
    # run: closing the cell only removes its name (each rank handle has its own mapping). Left
    # to garbage collection at finalization, the file stayed and showed as a stale cell.
    for cell in list(_open_cells):
        cell.close()


class ControlCell(_Handle):
    """The engine's cell for `nranks` ranks (FERRY_CTL_DIR/ferry-ctl-NAME), live while this
    process lives and until close() (or the interpreter's exit, which closes it). A dead
    engine's stale cell is replaced (incarnation + 1) unless fail_if_stale. AlreadyExists when
    a live engine owns the name."""

    _close_fn = staticmethod(lib.ferry_ctl_cell_close)

    def __init__(self, name: str, nranks: int, fail_if_stale: bool = False) -> None:
        super().__init__()
        self.name = name
        opts = CellOpts(ctypes.sizeof(CellOpts), 1 if fail_if_stale else 0)
        h = c_void_p()
        check(lib.ferry_ctl_cell_create(_name(name), _lib.c_int_of(nranks, c_uint32, "nranks"),
                                        byref(opts), byref(h)))
        self._h = h.value
        _open_cells.add(self)

    @property
    def incarnation(self) -> int:
        """How many times this cell was created under its name (a new engine process: a new one)."""
        return int(lib.ferry_ctl_cell_incarnation(self.handle))


class ControlRank(_Handle):
    """Rank `rank` of the cell `name`. initial_state: "serving" (default) or "cleared" for a
    rank that starts without weights. One thread drives a rank."""

    _close_fn = staticmethod(lib.ferry_ctl_rank_close)

    def __init__(self, name: str, rank: int, initial_state: Union[str, int] = "serving") -> None:
        super().__init__()
        self.name, self.rank = name, _lib.c_int_of(rank, c_uint32, "rank")
        opts = RankOpts(ctypes.sizeof(RankOpts), _state_code(initial_state))
        h = c_void_p()
        check(lib.ferry_ctl_rank_open(_name(name), self.rank, byref(opts), byref(h)))
        self._h = h.value
        self.state = STATES[opts.initial_state or 1]
        self.command: Optional[Command] = None  # the last command taken
        self._acked = True

    def wait(self, timeout: Optional[float] = None) -> Command:
        """The next command (a Command(seq, cmd)); a rank that lagged behind gets the newest.
        Taking clear or update publishes clearing or updating. Raises ferry.Timeout when none
        came in time (timeout 0: just look; None: FERRY_TIMEOUT_MS)."""
        out = CtlCommand()
        check(lib.ferry_ctl_wait_command(self.handle, _ms(timeout), byref(out)))
        self.command = Command(int(out.seq), COMMANDS.get(out.cmd, "?"))
        self._acked = False
        return self.command

    def ack(self, state: Union[str, int, None] = None,
            error: Union[BaseException, int, bool, None] = None, message: Optional[str] = None,
            seq: Optional[int] = None) -> None:
        """Acknowledges the last command taken. state: the rank's resulting state (None: what
        the command ends in when it worked: clear -> "cleared", update -> "serving", abort ->
        the last state). error: a failure (a ferry.Error, an exception, a negative FERRY_E* code
        or True) acks "failed" with a message (at most 31 bytes; default: the error's text)."""
        if self.command is None:
            raise InvalidArgument(-1, "ack: no command taken yet")
        seq = self.command.seq if seq is None else _lib.c_int_of(seq, c_uint64, "seq")
        code = 0
        if error is not None and error is not False:
            state = "failed"
            if isinstance(error, Error):
                code = error.status
                message = message if message is not None else (error.detail or str(error))
            elif isinstance(error, BaseException):
                code = -19  # FERRY_ESYS: the handler's own failure
                message = message if message is not None else \
                    ("%s: %s" % (type(error).__name__, error))
            elif error is True:
                code = -19
            else:
                code = _lib.c_int_of(error, c_int, "error")
        elif state is None:
            state = {"clear": "cleared", "update": "serving"}.get(self.command.cmd, self.state)
            if state == "failed":  # abort after a failure: still failed
                code, message = -16, message or "aborted"
        msg = None if message is None else message.encode(errors="replace")[:MESSAGE_MAX - 1]
        check(lib.ferry_ctl_ack(self.handle, seq, _state_code(state), code, msg))
        self.state = state if isinstance(state, str) else STATES[state]
        self._acked = True

    def step(self, clear: Optional[Callable[[], Any]] = None,
             update: Optional[Callable[[], Any]] = None,
             abort: Optional[Callable[[], str]] = None,
             timeout: Optional[float] = None) -> Command:
        """One turn of a rank's loop: waits for a command, runs its handler and acks the result.
        clear()/update() succeed by returning; an exception acks "failed" with its message (the
        controller's request raises naming this rank), and is not re-raised here. update is the
        commit step: return only once the new weights are complete and verified (e.g. a refit
        receiver's wait()). abort() returns the state to report (default: the last one). A
        clear while cleared acks at once; an update while not cleared fails. Returns the
        Command handled; raises ferry.Timeout when none came."""
        cmd = self.wait(timeout)
        if cmd.cmd == "clear":
            if self.state == "cleared":
                self.ack("cleared")
            else:
                self._run(clear, "cleared")
        elif cmd.cmd == "update":
            if self.state != "cleared":
                self.ack(error=-21, message="update while %s" % self.state)
            else:
                self._run(update, "serving")
        else:
            st = abort() if abort is not None else self.state
            if st not in ("serving", "cleared", "failed"):
                st = "failed"
            if st == "failed":
                self.ack(error=-16, message="aborted")
            else:
                self.ack(st)
        return cmd

    def _run(self, fn: Optional[Callable[[], Any]], ok_state: str) -> None:
        try:
            if fn is not None:
                fn()
        except Exception as e:  # reported to the controller, as the C rank_step does
            self.ack(error=e)
        else:
            self.ack(ok_state)


class Control(_Handle):
    """A controller's handle on the cell `name` (thread-safe). NotFound when there is none."""

    _close_fn = staticmethod(lib.ferry_ctl_close)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        h = c_void_p()
        check(lib.ferry_ctl_open(_name(name), byref(h)))
        self._h = h.value

    def request(self, cmd: str, timeout: Optional[float] = None) -> None:
        """Issues "clear", "update" or "abort" and returns once every rank acked it (seconds;
        None: FERRY_TIMEOUT_MS). Raises StateError (invalid transition, nothing issued), Busy
        (another command in flight or another controller won; nothing issued), Timeout (the
        command stays issued), PeerGone (a rank is dead), Closed (superseded by an abort),
        Stale (the engine died or its cell was replaced), NotFound (the engine closed the
        cell), or the failing rank's error (the detail names the rank)."""
        if cmd not in ("clear", "update", "abort"):
            raise InvalidArgument(-1, "no command %r (clear, update or abort)" % (cmd,))
        check(lib.ferry_ctl_request(self.handle, _CMD_CODE[cmd], _ms(timeout)))

    def wait_ranks(self, n: Optional[int] = None, timeout: Optional[float] = None) -> int:
        """Waits until at least n ranks (None: all of them) are attached and alive, as a request
        needs (otherwise it fails "rank 1 is not attached"), and returns how many are. Raises
        ferry.Timeout naming the ranks still missing after `timeout` seconds (None:
        FERRY_TIMEOUT_MS; 0: just look). Polls the rank lines (a rank's attach wakes nobody):
        every millisecond at first, then less often, up to every 20 ms."""
        nranks = self.status(ranks=False)["nranks"]
        want = nranks if n is None else _lib.c_int_of(n, c_uint32, "n", 0, nranks)
        if timeout is None:
            timeout = int(lib.ferry_config_get(b"FERRY_TIMEOUT_MS") or b"10000") / 1000.0
        deadline = time.monotonic() + max(0.0, float(timeout))
        pause = 0.001
        while True:
            missing = [i for i in range(nranks) if not self._attached(i)]
            if nranks - len(missing) >= want:
                return nranks - len(missing)
            if time.monotonic() >= deadline:
                raise Timeout(-4, "cell '%s': %d of %d ranks attached after %g s, %d wanted "
                                  "(missing: %s)" % (self.name, nranks - len(missing), nranks,
                                                     timeout, want,
                                                     ", ".join(map(str, missing))))
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    def _attached(self, rank: int) -> bool:
        st = self.rank_status(rank)
        return bool(st["pid"]) and st["alive"]

    def status(self, ranks: bool = True) -> Dict[str, Any]:
        """A snapshot: {incarnation, nranks, engine_pid, engine_alive, seq, cmd, in_flight,
        state, agreed, ranks: [{rank, pid, alive, seq, state, fail_seq, error, message}]}."""
        st = CtlStatus()
        st.size = ctypes.sizeof(st)
        check(lib.ferry_ctl_status_get(self.handle, byref(st)))
        out = {"incarnation": int(st.incarnation), "nranks": int(st.nranks),
               "engine_pid": int(st.engine_pid), "engine_alive": bool(st.engine_alive),
               "seq": int(st.seq), "cmd": COMMANDS.get(st.cmd, "?"),
               "in_flight": bool(st.in_flight), "state": STATES.get(st.state, "?"),
               "agreed": bool(st.agreed)}
        if ranks:
            out["ranks"] = [self.rank_status(i) for i in range(st.nranks)]
        return out

    def rank_status(self, rank: int) -> Dict[str, Any]:
        """One rank's status: {rank, pid, alive, seq, state, fail_seq, error, message}."""
        rs = CtlRankStatus()
        rs.size = ctypes.sizeof(rs)
        check(lib.ferry_ctl_rank_status_get(self.handle, _lib.c_int_of(rank, c_uint32, "rank"),
                                            byref(rs)))
        return {"rank": int(rs.rank), "pid": int(rs.pid), "alive": bool(rs.alive),
                "seq": int(rs.seq), "state": STATES.get(rs.state, "?"),
                "fail_seq": int(rs.fail_seq), "error": int(rs.error),
                "message": rs.message.decode(errors="replace")}
