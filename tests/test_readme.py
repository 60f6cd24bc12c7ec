"""The README's Python blocks run as written (CPU, virtual devices), in order, in one namespace as
a reader pasting them would; a block whose first line says it needs a GPU runs in tests/test_gpu*."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_python_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write files (a trace) where they run
    found = blocks()
    assert len(found) >= 2, "the README lost its examples"
    ns: dict = {}
    printed = []
    for code in found:
        if code.startswith("# on a GPU"):
            continue
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(code, str(README), "exec"), ns)
        printed.append(out.getvalue())
    assert len(printed) >= 3
    np = ns["np"]
    # what the blocks claim: the seed plan gathers 8 times and computes a @ b; the MLP block's collectives
    assert ns["plan"].collectives() == {"allgather": 8}
    assert (tmp_path / "trace.json").exists() and ns["tl"].summary()["steps"] == len(ns["tl"])
    np.testing.assert_allclose(ns["c"].gather(), ns["np_a"].astype(np.float64) @ ns["np_b"], rtol=1e-4, atol=1e-4)
    assert any("{'allgather': 4, 'reduce_scatter': 4}" in text for text in printed)
    assert any("{'allreduce': 2}\n{}\n" in text for text in printed)  # sf.random's block: a sampled decode step, dropout
    assert [t.shape for t in ns["tokens"]] == [(4,)] * 3 and not all((t == ns["tokens"][0]).all() for t in ns["tokens"])
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


def _mse_gradient_float64(params, xs, ys):
    """The Training block's loss and its gradient, by hand in float64 NumPy."""
    w1, w2 = (np.asarray(params[k], np.float64) for k in ("w1", "w2"))
    h = np.tanh(xs @ w1)
    r = h @ w2 - ys
    d = 2 * r / r.size
    return float((r ** 2).mean()), {"w1": xs.T @ ((d @ w2.T) * (1 - h ** 2)), "w2": h.T @ d}


def test_readme_training_block_claims(tmp_path, monkeypatch):
    """The Training block: gradients with the parameters' layouts, equal to the hand-written
    float64 gradient; the SGD steps' losses fall and each is the loss of the parameters it got;
    the donated parameters are updated in place in the plan."""
    import shardfuse as sf

    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for code in blocks():
        if not code.startswith("# on a GPU"):
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, str(README), "exec"), ns)
    first, xs, ys, grads, losses = (ns[k] for k in ("first_params", "xs", "ys", "grads", "losses"))
    loss0, want = _mse_gradient_float64(first, xs, ys)
    assert grads["w1"].placements == (sf.Shard(1),) and grads["w2"].placements == (sf.Shard(0),)
    for k in want:
        np.testing.assert_allclose(np.asarray(grads[k]), want[k], rtol=1e-12, atol=1e-14)
    assert abs(losses[0] - loss0) < 1e-12 and all(b < a for a, b in zip(losses, losses[1:])), losses
    params = first
    for loss in losses:  # each step's loss is that of the parameters it took; SGD by hand in float64
        value, g = _mse_gradient_float64(params, xs, ys)
        assert abs(loss - value) < 1e-12
        params = {k: np.asarray(params[k], np.float64) - 0.1 * g[k] for k in g}
    for k in params:
        np.testing.assert_allclose(np.asarray(ns["params"][k]), params[k], rtol=1e-10, atol=1e-12)
    _, at_end = _mse_gradient_float64(params, xs, ys)
    for k in at_end:  # sf.grad outside jit, at the trained parameters
        assert ns["grads_now"][k].placements == grads[k].placements
        np.testing.assert_allclose(np.asarray(ns["grads_now"][k]), at_end[k], rtol=1e-9, atol=1e-12)
    text = str(ns["sgd_step"].lower(ns["params"], xs, ys))
    assert "Fused params_w1 <- params_w1, " in text and "Fused params_w2 <- params_w2, " in text  # w - lr * g, one step
