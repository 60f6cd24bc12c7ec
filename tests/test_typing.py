"""shardfuse is typed (PEP 561, shardfuse/py.typed): mypy reads its annotations in a user's
script.  The package is installed the way users get it (a non-editable install into a folder),
then mypy checks two scripts: a correct one passes, and a wrong one is caught by shardfuse's types."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GOOD = '''
import numpy as np
import shardfuse as sf

mesh = sf.DeviceMesh(4, backend="numpy")


@sf.jit(mesh=mesh, streams=2)
def ag_matmul(a, b):
    return sf.stream(sf.shard(a, axis=1) @ b, axis=0)


c = ag_matmul(np.ones((2, 4, 3, 5)), np.ones((5, 2)))
plan = ag_matmul.lower(sf.TensorSpec((2, 4, 3, 5), "float64"), sf.TensorSpec((5, 2), "float64"))
counts: dict[str, int] = plan.collectives()
whole: np.ndarray = sf.shard(np.ones((4, 2)), axis=0, mesh=mesh).gather()
'''

BAD = GOOD + '''
n: int = sf.DeviceMesh(4)
s: str = plan.collectives()
'''


def test_mypy_reads_shardfuses_types_in_a_user_script(tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (target / "shardfuse" / "py.typed").exists()
    results = {}
    for name, code in (("good", GOOD), ("bad", BAD)):
        script = tmp_path / f"{name}.py"
        script.write_text(code)
        results[name] = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-incremental",
                                        str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                                       env={"MYPYPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert results["good"].returncode == 0, results["good"].stdout
    bad = results["bad"].stdout
    assert results["bad"].returncode == 1 and 'has type "DeviceMesh", variable has type "int"' in bad, bad
    assert 'has type "dict[str, int]", variable has type "str"' in bad, bad
