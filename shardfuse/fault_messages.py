"""What the fault handling says: the names of plan steps (as a timeout names the step it waited
in), the one message every rank raises when ranks compiled different plans, and how a rank
that aborts the job gets its last words out."""
from __future__ import annotations

import os
import stat
import sys
import threading
import time
from contextlib import contextmanager

from shardfuse.dtypes import short_name

_binding = threading.local()


@contextmanager
def binding(plan_name: str):
    """Collectives bound inside are named after the plan and their place in it (the backend
    never sees the IR, so this is where the plan's name comes from)."""
    _binding.plan, _binding.count = plan_name, 0
    try:
        yield
    finally:
        _binding.plan = None


def step_name(kind: str, team, ref=None) -> str:
    """e.g. "allgather #2 of plan 'f' over DIDx (f32[1, 4, 16, 32] per device)"."""
    plan = getattr(_binding, "plan", None)
    where = ""
    if plan is not None:
        _binding.count += 1
        where = f" #{_binding.count} of plan {plan!r}"
    if isinstance(team, tuple):  # (sub-mesh, axis name)
        team = f"{team[1]} of sub-mesh devices {team[0].devices}"
    what = f"{kind}{where}"
    if team is not None:
        what += f" over {team}"
    if ref is not None:
        what += f" ({short_name(ref.dtype)}{list(ref.shape)} per device)"
    return what


def ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))


def describe_mismatch(texts: list, what: str) -> str:
    """The same message on every rank: which ranks hold which text, and the first line where
    each group's text differs from rank 0's.  Each text's first line says what the rank is
    checking (a plan, a mesh's backend): ranks at different ones are told that instead."""
    heads: dict = {}
    for r, t in enumerate(texts):
        heads.setdefault(t.split("\n", 1)[0], []).append(r)
    if len(heads) > 1:
        return ("the ranks reached different collective steps (found before any of them communicated): "
                + "; ".join(f"rank(s) {ranks_text(rs)} at {h}" for h, rs in heads.items())
                + "\nevery rank must make the same shardfuse calls in the same order; the first use of a mesh "
                "(placing an array on it with sf.shard, sf.replicate or sf.from_local, or a call) sets up its "
                "backend, which every rank must do too")
    texts = [t.split("\n", 1)[1] if "\n" in t else "" for t in texts]
    groups: dict = {}
    for r, t in enumerate(texts):
        groups.setdefault(t, []).append(r)
    ref = texts[0].splitlines()
    lines = [f"the ranks compiled different versions of {what} (found before its first collective): "
             + "; ".join(f"version {chr(65 + i)} on rank(s) {ranks_text(rs)}" for i, rs in enumerate(groups.values()))]
    for t, rs in list(groups.items())[1:]:
        other = t.splitlines()
        k = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
        lines.append(f"first difference between rank 0 and rank {rs[0]}, line {k + 1}:")
        lines.append(f"  rank 0: {ref[k] if k < len(ref) else '(end of text)'}")
        lines.append(f"  rank {rs[0]}: {other[k] if k < len(other) else '(end of text)'}")
    lines.append("every rank must call the same function with the same shapes, dtypes, shardings, chunks, "
                 "algorithms and mesh, in the same order")
    return "\n".join(lines)


def emit(message: str, drain=(), wait_s: float = 2.0) -> None:
    """Write to the real stderr and wait until the launcher has read what we wrote: MPICH's
    hydra drops output still in the pipe when an Abort arrives (seen here: 2 runs in 60 lost
    the aborting rank's whole output), and the message is the point of aborting.  At most
    wait_s seconds."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    if message:
        try:
            os.write(2, message.encode("utf-8", "replace"))
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    for fd in (1, 2, *drain):
        while unread(fd) > 0 and time.monotonic() < deadline:
            time.sleep(0.002)


def unread(fd: int) -> int:
    """Bytes written to pipe `fd` and not yet read by the other end (0 if not a pipe)."""
    import fcntl
    import struct
    import termios

    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0
