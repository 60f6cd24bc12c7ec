"""The `shardfuse` command: `shardfuse demo`, `shardfuse bench`, `shardfuse profile`."""
from __future__ import annotations

import sys

USAGE = """usage: shardfuse {demo,bench,profile} [options]   (shardfuse COMMAND --help for options; --version)

  demo     run the seed's pipelined AllGather+GEMM, print its plan, check and time it
  bench    time pipelined and unpipelined plans, the GEMM alone and the Allgather alone
  profile  the seed's plan step by step: a Chrome trace, a Gantt chart, the overlap figures
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
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from shardfuse.demo import main as run
    elif cmd == "bench":
        from shardfuse.bench import main as run
    elif cmd == "profile":
        from shardfuse.profile_cli import main as run
    else:
        print(f"shardfuse: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
