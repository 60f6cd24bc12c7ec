"""Under mpiexec: ranks agree on a plan or fail together, and no rank waits forever.

MPI itself gives neither.  A Python exception on one rank runs the interpreter's exit path,
whose MPI_Finalize waits for ranks that are themselves waiting in a collective for the
failed one: the job hangs.  A rank that calls a different plan (another shape, chunk count,
mesh, ...) pairs its collectives with the wrong ones: a hang, or garbage.  So, once
shardfuse first touches MPI with more than one process (`install`, from mesh.world()):

* an uncaught exception (any thread) prints its traceback and calls MPI.COMM_WORLD.Abort, as
  `python -m mpi4py` would, so every rank ends;
* a rank that leaves (its script ends, `sys.exit(any code)`) tells the others (a message on a
  private communicator) and waits, up to the deadline, for them to leave too.  A rank waiting
  in a shardfuse collective for a rank that has left aborts the job: it can never complete;
* every wait of the NumPy-over-MPI backend, the checks and the exit polls its requests until
  SHARDFUSE_TIMEOUT seconds have passed (default 600, like NCCL's watchdog; 0 or less: none),
  then asks the ranks it waits for where they are, reports the step and the ranks that did not
  arrive, and aborts;
* before every call of a plan (and gather, from_local, ...), `agree` checks that every rank is
  at the same step (one 16-byte allgather) and raises RankMismatchError on every rank if not;
* a process' collective calls all come from one thread (`one_thread`): ranks pair collectives
  in the order each issues them, and threads would interleave differently on each rank.

Nothing here does anything in one process, or under mpiexec -n 1.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import pickle
import sys
import threading
import time
import traceback

from shardfuse.fault_messages import A_CALL, binding, checking_inputs, describe_inputs, describe_mismatch, emit, input_prints, ranks_text, step_name  # noqa: F401 (A_CALL, binding, checking_inputs, input_prints, step_name: used as faults.*)

TIMEOUT_ENV = "SHARDFUSE_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
# How long a wait goes on after a peer it waits for has left: a peer may leave as soon as its
# own side of a collective is done, while ours still completes from data already sent.
LEFT_GRACE = 2.0
ANSWER_WAIT = 1.0  # how long a timed-out rank waits for its peers to say where they are
DRAIN_WAIT = 2.0  # at most this long for the launcher to read our last output before Abort
SPIN = 0.01  # a wait polls without sleeping for this long (seconds), then sleeps between polls

_LEFT, _ASK, _ANSWER = 1, 2, 3  # message tags on the private control communicator


class RankMismatchError(RuntimeError):
    """The ranks of an MPI job compiled different plans (raised on every rank, before any
    collective of the plan)."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within SHARDFUSE_TIMEOUT seconds (the job is aborted)."""


class RankLeftError(RuntimeError):
    """A rank left the job while another waited for it in a collective (the job is aborted)."""


def timeout() -> float:
    """The deadline of one wait, in seconds (inf for none)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    return value if value > 0 else float("inf")


_job = None  # the _Job once installed (more than one process)


def install(comm) -> None:
    """Set up the control communicators and the hooks (idempotent; collective the first time,
    but non-blocking: a rank that never gets here does not hang the others here)."""
    global _job
    if _job is not None or comm.Get_size() < 2:
        return
    _job = _Job(comm)
    _job.previous_excepthook = sys.excepthook
    sys.excepthook = _job.excepthook
    _job.previous_threading_hook = threading.excepthook
    threading.excepthook = _job.threading_excepthook
    # atexit runs last-registered first: this runs before mpi4py's own MPI_Finalize
    atexit.register(_job.leave)


def active() -> bool:
    return _job is not None


_OWNER: dict = {}  # "thread": the thread that makes this process' collective calls


def one_thread(what: str) -> None:
    """Raise, before `what` communicates, unless it comes from the thread of this process' first
    collective call (threads would reach the collectives in another order on each rank)."""
    if _OWNER.setdefault("thread", threading.get_ident()) != threading.get_ident():  # (atomic)
        raise RuntimeError(f"{what} from thread {threading.current_thread().name!r}: under mpiexec every shardfuse "
                           "call that communicates must come from one thread per process; ranks pair collectives in "
                           "the order each issues them, so calls from several threads would mix their data. Make "
                           "the calls from one thread (hand it the work, e.g. through a queue)")


# ---- waits ----------------------------------------------------------------------------------
def wait(reqs, what: str, peers) -> None:
    """Wait for MPI request(s) (a Request or a list), up to the deadline.  peers: the
    communicator the requests run on, or the world ranks they involve (for the report)."""
    from mpi4py import MPI

    reqs = reqs if isinstance(reqs, list) else [reqs]
    if MPI.Request.Testall(reqs):  # the common case costs one Test
        return
    if _job is None:
        MPI.Request.Waitall(reqs)
        return
    _job.wait(reqs, what, peers)


def agree(text: str, what: str, inputs=()) -> None:
    """Every rank must hold the same `text` (a plan's printed program and its mesh), and the same
    `inputs` ((name, fingerprint bytes) of a call's host arguments): one small allgather of hashes;
    on a mismatch every rank raises the same RankMismatchError.  Does nothing in one process."""
    if _job is not None:
        _job.agree(text, what, inputs)


def allgather_bytes(comm, data: bytes, what: str) -> list:
    """Every rank's `data`, with the deadline (Iallgather of the lengths, then Iallgatherv)."""
    import numpy as np

    n = comm.Get_size()
    sizes = np.empty(n, np.int64)
    wait(comm.Iallgather(np.array([len(data)], np.int64), sizes), what, comm)
    out = np.empty(int(sizes.sum()), np.uint8)
    mine = np.frombuffer(data, np.uint8) if data else np.empty(0, np.uint8)
    from mpi4py import MPI

    wait(comm.Iallgatherv(mine, [out, sizes.tolist(), None, MPI.BYTE]), what, comm)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    return [out[offs[k]:offs[k + 1]].tobytes() for k in range(n)]


def allgather_object(obj, what: str) -> list:
    """Every rank's obj, with the deadline.  The ranks first agree that each is at this step
    (`what`: RankMismatchError if not), and the exchange runs on a private communicator, so it
    never pairs with a plan's collective (whose data it would read as its own)."""
    import pickle

    if _job is None:
        return [obj]
    agree("", what)
    return [pickle.loads(b) for b in allgather_bytes(_job.fp, pickle.dumps(obj), what)]


def barrier(comm, what: str) -> None:
    """Every rank of comm has arrived, with the deadline (put before blocking collectives that
    have no non-blocking form, e.g. Comm.Split, so they never wait for a rank that is not coming)."""
    if _job is not None:
        wait(comm.Ibarrier(), what, comm)


def abort(message: str, code: int = 1, drain=()) -> None:
    """Print `message` on stderr and end the whole MPI job (after the launcher has read what
    this process wrote to stdout, stderr and the file descriptors in `drain`)."""
    from mpi4py import MPI

    if _job is not None:
        _job.aborting = True
    emit(message, drain, DRAIN_WAIT)
    MPI.COMM_WORLD.Abort(code)


class _Job:
    """This process' part of the agreement: control communicators, what it waits in now, who left."""

    def __init__(self, world):
        self.world, self.rank, self.size = world, world.Get_rank(), world.Get_size()
        self.tag = f"[shardfuse rank {self.rank}/{self.size}]"
        # Private communicators, so no message or collective of ours can pair with the user's or
        # the backend's: ctrl for point-to-point notes (left / where are you), fp for plan checks.
        self.ctrl, self._ctrl_req = world.Idup()
        self.fp, self._fp_req = world.Idup()
        self.digests: dict = {}  # agreed text -> its hash
        self.left: set = set()  # ranks that told us they are leaving
        self.answers: dict = {}  # rank -> where it said it was (while we ask)
        self.waiting = None  # what this rank waits in now (answered when asked)
        self.sends: list = []  # our pending control sends
        self.aborting = False
        self._poll_lock = threading.Lock()
        self._peers: dict = {}  # comm handle -> world ranks of that comm but us

    # -- hooks --------------------------------------------------------------------------
    def excepthook(self, etype, value, tb):
        self.previous_excepthook(etype, value, tb)
        code = 130 if issubclass(etype, KeyboardInterrupt) else 1
        self.abort(f"{self.tag} uncaught {etype.__name__} on this rank (traceback above): aborting the MPI job\n",
                   code)

    def threading_excepthook(self, args):
        self.previous_threading_hook(args)
        if args.exc_type is SystemExit:  # ends that thread only, as without MPI
            return
        name = args.thread.name if args.thread is not None else "?"
        self.abort(f"{self.tag} uncaught {args.exc_type.__name__} in thread {name!r} (traceback above): "
                   "aborting the MPI job\n", 1)

    def abort(self, message, code=1):
        abort(message, code)

    def fatal(self, exc: BaseException):
        """Report exc with the stack that led here, then end the job: after a timeout or a lost
        peer the pending requests can never be completed or cancelled, so going on is not safe."""
        text = ("Traceback (most recent call last):\n" + "".join(traceback.format_stack(sys._getframe(1)))
                + "".join(traceback.format_exception_only(type(exc), exc)))
        self.abort(f"{text}{self.tag} aborting the MPI job\n", 1)

    # -- control messages -----------------------------------------------------------------
    def _ready(self) -> bool:
        if self._ctrl_req is not None:
            if not self._ctrl_req.Test():
                return False
            self._ctrl_req = None
        return True

    def poll(self):
        """Handle control messages: note who left, answer who asks where we are."""
        from mpi4py import MPI

        if not self._ready() or not self._poll_lock.acquire(blocking=False):
            return
        try:
            st = MPI.Status()
            while True:
                msg = self.ctrl.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, st)
                if msg is None:
                    break
                body, src, tag = msg.recv(), st.Get_source(), st.Get_tag()
                if tag == _LEFT:
                    self.left.add(src)
                elif tag == _ASK:
                    self.sends.append(self.ctrl.isend(self.waiting or "not inside a shardfuse wait", src, _ANSWER))
                elif tag == _ANSWER:
                    self.answers[src] = body
            self.sends = [r for r in self.sends if not r.Test()]
        finally:
            self._poll_lock.release()

    def peers_of(self, peers) -> set:
        if not hasattr(peers, "Get_group"):
            return set(peers) - {self.rank}
        key = peers.py2f()
        if key not in self._peers:
            from mpi4py import MPI

            ranks = MPI.Group.Translate_ranks(peers.Get_group(), list(range(peers.Get_size())), self.world.Get_group())
            self._peers[key] = set(ranks) - {self.rank}
        return self._peers[key]

    # -- waiting --------------------------------------------------------------------------
    def wait(self, reqs, what, peers):
        from mpi4py import MPI

        limit = timeout()
        start = time.monotonic()
        deadline = start + limit
        peers = self.peers_of(peers)
        outer, self.waiting = self.waiting, f"waiting in {what}"
        gone_since = None
        pause = 0.0
        try:
            while not MPI.Request.Testall(reqs):
                self.poll()
                now = time.monotonic()
                gone = sorted(self.left & peers)
                if gone:
                    gone_since = gone_since or now
                    if now - gone_since > LEFT_GRACE:
                        self.fatal(RankLeftError(
                            f"{self.tag} rank(s) {ranks_text(gone)} left the job (script ended or sys.exit) while "
                            f"this rank waited for them in {what}: that can never complete"))
                if now > deadline:
                    self.fatal(CollectiveTimeoutError(self._timeout_report(what, peers, limit)))
                # First only yield the core (a rank sleeping inside a collective delays its peers,
                # which need it to make progress), then sleep: a long wait should not spin a core
                # that ranks on the same machine may need (MPI's own Wait spins).
                if now - start < SPIN:
                    os.sched_yield()
                else:
                    time.sleep(pause)
                    pause = min(2 * pause or 1e-4, 1e-3)
        finally:
            self.waiting = outer

    def _timeout_report(self, what, peers, limit):
        """Ask the peers where they are; those waiting in the same step have arrived."""
        self.answers = {}
        if self._ready():
            for p in sorted(peers):
                self.sends.append(self.ctrl.isend(None, p, _ASK))
            end = time.monotonic() + ANSWER_WAIT
            while len(self.answers) < len(peers) and time.monotonic() < end:
                self.poll()
                time.sleep(0.005)
        mine = f"waiting in {what}"
        arrived = sorted(p for p in peers if self.answers.get(p) == mine)
        lines = [f"{self.tag} {what} did not complete within {limit:g} s ({TIMEOUT_ENV}); waiting for "
                 f"rank(s) {ranks_text(sorted(peers))}."]
        missing = [p for p in sorted(peers) if p not in arrived]
        if missing:
            lines.append(f"  not arrived: rank(s) {ranks_text(missing)}")
        for p in missing:
            where = self.answers.get(p)
            lines.append(f"    rank {p}: " + (where if where is not None else
                                               "no answer (not inside a shardfuse wait: computing, sleeping, "
                                               "blocked in another MPI call, or gone)"))
        if arrived:
            lines.append(f"  arrived (waiting in the same step): rank(s) {ranks_text(arrived)}")
        return "\n".join(lines)

    # -- the plan check -------------------------------------------------------------------
    def agree(self, text, what, inputs=()):
        import numpy as np

        one_thread(f"the check of {what}")
        if self._fp_req is not None:
            wait(self._fp_req, f"setting up the check of {what}", self.world)
            self._fp_req = None
        text = f"{what}\n{text}"  # (what each rank is at: ranks at different steps are told so)
        digest = self.digests.get(text)  # (a plan is checked at every call: its text hashed once)
        if digest is None:
            digest = np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), np.uint8)
            self.digests = self.digests if len(self.digests) < 256 else {}
            self.digests[text] = digest
        given = hashlib.blake2b(pickle.dumps(list(inputs)), digest_size=16).digest() if inputs else bytes(16)
        digest = np.concatenate([digest, np.frombuffer(given, np.uint8)])  # (the plan's hash, the arguments')
        every = np.empty((self.size, digest.size), np.uint8)
        wait(self.fp.Iallgather(digest, every), f"the check of {what}", self.fp)
        if (every == every[0]).all():
            return
        if (every[:, :16] == every[0, :16]).all():  # (one plan, other arguments)
            prints = [pickle.loads(b) for b in allgather_bytes(self.fp, pickle.dumps(list(inputs)), f"the check of {what}")]
            raise RankMismatchError(describe_inputs(prints, what))
        texts = [b.decode("utf-8", "replace") for b in allgather_bytes(self.fp, text.encode(), f"the check of {what}")]
        raise RankMismatchError(describe_mismatch(texts, what))

    # -- leaving --------------------------------------------------------------------------
    def leave(self):
        """At exit: tell the others, and wait (up to the deadline) until they have left too."""
        from mpi4py import MPI

        if self.aborting or MPI.Is_finalized():
            return
        others = set(range(self.size)) - {self.rank}
        limit = timeout()
        deadline = time.monotonic() + limit
        self.waiting = "finished: waiting at exit for the other ranks to finish"
        while not self._ready():
            if time.monotonic() > deadline:
                self.abort(f"{self.tag} the other ranks never set up shardfuse's control communicator "
                           f"within {limit:g} s ({TIMEOUT_ENV}): aborting the MPI job\n")
            time.sleep(0.001)
        for p in sorted(others):
            self.sends.append(self.ctrl.isend(None, p, _LEFT))
        pause = 1e-4
        while True:
            self.poll()
            if self.left >= others and not self.sends:
                return
            if time.monotonic() > deadline:
                self.abort(f"{self.tag} this rank has finished, but rank(s) {ranks_text(sorted(others - self.left))} "
                           f"did not finish within {limit:g} s ({TIMEOUT_ENV}): aborting the MPI job\n")
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)
