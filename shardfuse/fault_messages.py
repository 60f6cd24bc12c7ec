"""What the fault handling says: the names of plan steps (as a timeout names the step it waited
in), the one message every rank raises when ranks compiled different plans, and how a rank
that aborts the job gets its last words out."""
from __future__ import annotations

import functools
import os
import stat
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

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


A_CALL = " (a call)"  # how executor.check_ranks labels a plan's check at a call, apart from its binding's


def describe_mismatch(texts: list, what: str) -> str:
    """The same message on every rank: which ranks hold which text, and the first line where
    each group's text differs from rank 0's, with the inputs that differ where the plans' do.
    Each text's first line says what the rank is checking (a plan, a mesh's backend): ranks at
    different ones are told that instead; but a rank calling a plan it compiled before and one
    compiling a new plan of the same function (a short last batch on one rank) are told how
    the two plans differ."""
    heads: dict = {}
    for r, t in enumerate(texts):
        heads.setdefault(t.split("\n", 1)[0], []).append(r)
    if len(heads) > 1 and len({h.removesuffix(A_CALL) for h in heads}) == 1:  # one plan: called, or compiled
        what = next(iter(heads)).removesuffix(A_CALL)
        how = "; ".join(f"rank(s) {ranks_text(rs)} " + ("call the plan compiled at an earlier call"
                                                        if h.endswith(A_CALL) else "compile a new plan for this call")
                        for h, rs in heads.items())
        if len({t.split("\n", 1)[-1] for t in texts}) == 1:  # (the same plan compiled again: a cache dropped it)
            return (f"the ranks are at different steps of {what} (found before its first collective): {how}, the same "
                    "plan (one rank's plan cache dropped it: every rank must make the same calls, in the same order)")
        return _versions(texts, what, f"{what} differs between the ranks at this call (found before its first "
                                      f"collective): {how}; the plans")
    if len(heads) > 1:
        return ("the ranks reached different collective steps (found before any of them communicated): "
                + "; ".join(f"rank(s) {ranks_text(rs)} at {h}" for h, rs in heads.items())
                + "\nevery rank must make the same shardfuse calls in the same order; the first use of a mesh "
                "(placing an array on it with sf.shard, sf.replicate or sf.from_local, or a call) sets up its "
                "backend, which every rank must do too")
    return _versions(texts, what)


def _versions(texts: list, what: str, lead: str = "") -> str:
    """Which ranks hold which version of `what` (the texts after their first line), the first line
    where each differs from rank 0's, and the plan inputs whose types differ; after `lead` if given."""
    texts = [t.split("\n", 1)[1] if "\n" in t else "" for t in texts]
    groups: dict = {}
    for r, t in enumerate(texts):
        groups.setdefault(t, []).append(r)
    ref = texts[0].splitlines()
    lead = lead or f"the ranks compiled different versions of {what} (found before its first collective)"
    lines = [f"{lead}: " + "; ".join(f"version {chr(65 + i)} on rank(s) {ranks_text(rs)}"
                                      for i, rs in enumerate(groups.values()))]
    for t, rs in list(groups.items())[1:]:
        other = t.splitlines()
        k = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
        lines.append(f"first difference between rank 0 and rank {rs[0]}, line {k + 1}:")
        lines.append(f"  rank 0: {ref[k] if k < len(ref) else '(end of text)'}")
        lines.append(f"  rank {rs[0]}: {other[k] if k < len(other) else '(end of text)'}")
        lines.extend(_inputs_differ(ref, other, rs[0]))
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


def _inputs_differ(ref: list, other: list, rank: int) -> list:
    """A line naming the plan inputs (`x: f64[8:DIDx, 6]`) whose types differ between rank 0's plan
    text and `rank`'s: the argument shapes, dtypes or layouts the calls passed.  None where the
    headers cannot be read as plans of the same inputs."""
    a, b = (_plan_inputs(t) for t in (ref, other))
    if a is None or b is None or [n for n, _ in a] != [n for n, _ in b]:
        return []
    diff = [f"{n}: {t} on rank 0, {u} on rank {rank}" for (n, t), (_, u) in zip(a, b) if t != u]
    return [f"  the inputs differ: {'; '.join(diff)}"] if diff else []


def _plan_inputs(lines: list):
    """[(name, type)] of the first `plan name(x: f64[8, 6], ...) -> (...)` line, or None."""
    head = next((s for s in lines if s.startswith("plan ") and "(" in s and ") -> (" in s), None)
    if head is None:
        return None
    inner, parts, depth, cur = head[head.index("(") + 1:head.rindex(") -> (")], [], 0, ""
    for ch in inner:  # (split at the commas outside brackets: f64[8:DIDx, 6])
        depth += (ch in "[(") - (ch in "])")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return [tuple(p.split(": ", 1)) if ": " in p else (p, "") for p in parts]


def describe_inputs(prints: list, what: str) -> str:
    """The same message on every rank where the ranks call one plan on different host arguments:
    the first argument whose fingerprints differ, and which ranks hold which."""
    if len({tuple(n for n, _ in mine) for mine in prints}) > 1:  # (an sf.Array on some ranks, a NumPy array on others)
        held = "; ".join(f"rank {r}: {', '.join(n for n, _ in mine) or 'none'}" for r, mine in enumerate(prints))
        return (f"{what}: the ranks pass host arrays for different arguments ({held}): pass each argument alike on "
                "every rank (an sf.Array everywhere, or a NumPy array everywhere)")
    for k, (name, _) in enumerate(prints[0]):
        groups: dict = {}
        for r, mine in enumerate(prints):
            groups.setdefault(mine[k][1], []).append(r)
        if len(groups) > 1:
            held = "; ".join(f"rank(s) {ranks_text(rs)} one value" if n == 0 else f"rank(s) {ranks_text(rs)} another"
                             for n, rs in enumerate(groups.values()))
            return (f"{what}: argument {name} differs between the ranks ({held}).  Every rank passes the same global "
                    "array, of which each takes its own pieces (as JAX's multi-process jit); for data that differs per "
                    "rank, make the global array with sf.from_local.  (Checked on a sample of each NumPy argument's "
                    "elements; SHARDFUSE_CHECK_INPUTS=0 turns the check off.)")
    return f"{what}: the ranks' arguments differ"


SAMPLE = 64  # elements of each NumPy argument the ranks compare (CHECK_ENV)
CHECK_ENV = "SHARDFUSE_CHECK_INPUTS"


@functools.lru_cache(maxsize=256)
def _sample_at(size: int):
    """SAMPLE flat indices spread over an array of `size` elements (its first and last included)."""
    return np.linspace(0, size - 1, min(size, SAMPLE)).astype(np.int64)


def checking_inputs() -> bool:
    """Whether the ranks compare their host arguments (SHARDFUSE_CHECK_INPUTS, default on)."""
    return os.environ.get(CHECK_ENV) != "0"


def input_prints(names, args, infos, host=None) -> list:
    """(name, fingerprint) of each host argument of a call (NumPy arrays: shape and SAMPLE elements spread
    over them, as float64 with -0.0 as 0.0 and one NaN where floating, so byte order, signed zeros and
    NaN payloads do not differ; Python and NumPy numbers: their Python value), for faults.agree: ranks
    passing different global arrays would each take its pieces of its own (a blend, silently).
    sf.Arrays (info None) and device arrays are not read; empty with SHARDFUSE_CHECK_INPUTS=0.  A few
    microseconds an argument (a sample, not the data: ranks whose arrays differ only between the
    samples pass).  `host(a, info)`: a host array of another library as NumPy (interop.host_view), called
    here, inside the guard.  Never raises: every rank must reach the check's allgather."""
    if not checking_inputs():
        return []
    out = []
    for name, a, info in zip(names, args, infos):
        if info is None:
            continue
        try:
            out.append((name, fingerprint(a if host is None else host(a, info))))
        except Exception as e:  # noqa: BLE001 (whatever it is, this rank still takes part in the check)
            out.append((name, f"unreadable: {type(e).__name__}".encode()))
    return out


def fingerprint(a) -> bytes:
    """One host argument's fingerprint (input_prints): b"" for a device array (not read)."""
    if isinstance(a, (bool, int, float, complex, np.generic)):
        v = a.item() if isinstance(a, np.generic) else a
        return repr(v + 0.0 if isinstance(v, float) else v).encode()  # (-0.0 + 0.0 is 0.0)
    if not isinstance(a, np.ndarray):
        return b""  # (a device array: not read)
    a = np.asarray(a)  # (np.matrix: a plain array, so its flat sample is of elements)
    sample = (a.reshape(-1) if a.flags.c_contiguous else a.flat)[_sample_at(a.size)]
    if sample.dtype.kind in "fcV" and sample.dtype != object:
        try:
            sample = np.asarray(sample, np.complex128 if sample.dtype.kind == "c" else np.float64)
        except (TypeError, ValueError):
            return repr(a.shape).encode() + sample.tobytes()
        sample = np.where(np.isnan(sample), np.nan, sample) + 0.0  # (one NaN; -0.0 + 0.0 is 0.0)
    else:
        sample = sample.astype(sample.dtype.newbyteorder("="))
    return repr(a.shape).encode() + sample.tobytes()
