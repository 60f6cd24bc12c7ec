"""The README's Python blocks run as written (CPU, virtual devices), in order, in one namespace as
a reader pasting them would; a block whose first line says it needs a GPU runs in tests/test_gpu*."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write files (a trace) where they run
    found = blocks()
    assert len(found) >= 2, "the README lost its examples"
    ns: dict = {}
    ran = 0
    for code in found:
        if code.startswith("# on a GPU"):
            continue
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(code, str(README), "exec"), ns)
        ran += 1
    assert ran >= 2
    np = ns["np"]
    # what the blocks claim: the seed plan gathers 8 times and computes a @ b; the MLP block's collectives
    assert ns["plan"].collectives() == {"allgather": 8}
    assert (tmp_path / "trace.json").exists() and ns["tl"].summary()["steps"] == len(ns["tl"])
    np.testing.assert_allclose(ns["c"].gather(), ns["np_a"].astype(np.float64) @ ns["np_b"], rtol=1e-4, atol=1e-4)
    assert "{'allgather': 4, 'reduce_scatter': 4}" in out.getvalue()
    x, w1, b1, w2, b2 = (ns[k] for k in ("x", "w1", "b1", "w2", "b2"))
    h = x @ w1 + b1
    gelu = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    np.testing.assert_allclose(ns["y"].gather(), gelu @ w2 + b2, rtol=1e-10, atol=1e-10)


def test_every_environment_variable_is_in_the_readme_table():
    root = README.parent
    used = set()
    for path in list((root / "shardfuse").rglob("*.py")) + list((root / "backends").rglob("*.py")):
        used |= set(re.findall(r"\bSHARDFUSE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    table = re.search(r"### Settings\n(.*?)\n### ", README.read_text(), re.S).group(1)
    listed = set(re.findall(r"`(SHARDFUSE_[A-Z0-9_]+)", table))
    assert used <= listed, f"not in the README's table: {sorted(used - listed)}"
    assert listed <= used, f"in the table but read nowhere: {sorted(listed - used)}"
