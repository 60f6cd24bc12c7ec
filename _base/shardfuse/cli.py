"""The `shardfuse` command: `shardfuse demo`, `bench`, `profile`, `calibrate`, `simulate`."""
from __future__ import annotations

import sys

USAGE = """usage: shardfuse {demo,bench,profile,calibrate,simulate} [options] [--debug]   (shardfuse COMMAND --help; --version)

  demo       run the seed's pipelined AllGather+GEMM, print its plan, check and time it
  bench      time pipelined and unpipelined plans, the GEMM alone and the Allgather alone
  profile    the seed's plan step by step: a Chrome trace, a Gantt chart, the overlap figures
  calibrate  measure this machine's rates for the cost model (chunks="auto") and cache them
  simulate   predict a plan's timeline on D GPUs from published figures (seed case or MLP)
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from shardfuse import __version__

        print(f"shardfuse {__version__}")
        return 0
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from shardfuse.demo_model import main as run
    elif cmd == "bench":
        from shardfuse.bench import main as run
    elif cmd == "profile":
        from shardfuse.profile_cli import main as run
    elif cmd == "calibrate":
        from shardfuse.calibrate import main as run
    elif cmd == "simulate":
        from shardfuse.simulate import main as run
    else:
        print(f"shardfuse: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return run(rest)
    except (ValueError, TypeError, NotImplementedError, ImportError, OSError, MemoryError) as e:  # OSError: a file
        if debug:  # not writable; MemoryError: sizes too large for this machine
            raise
        if isinstance(e, MemoryError):
            e = f"{e or 'out of memory'}: the sizes asked for do not fit this machine's memory (smaller --m / --devices)"
        # a user's mistake: one line (once, not from every rank), no traceback (--debug shows it)
        from shardfuse.mesh import launched_by_mpi

        rank = 0
        if launched_by_mpi():
            from mpi4py import MPI

            rank = MPI.COMM_WORLD.Get_rank()
        if rank == 0:
            print(f"shardfuse {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
