"""`shardfuse bench` on the NumPy backend, tiny sizes: the rows are the variants asked for, their
results are checked (and the check fails where it should), the ratios agree with the rows they
come from, the one timing loop calls each variant as its schedule says and times what it calls,
memory figures add up, and the package keeps to the protocol and its size limits."""
import ast
import contextlib
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.backends.protocol import Backend
from shardfuse.bench import cli, host, main, memory, report, runner
from shardfuse.bench.clocks import HostClock, device_streams
from shardfuse.bench.inputs import Inputs, f64, rel_err
from shardfuse.demo import seed_functions
from shardfuse.dtypes import np_dtype
from shardfuse.runtime import backend_of

ROOT = Path(__file__).resolve().parents[1]
BENCH = sorted((ROOT / "shardfuse" / "bench").glob("*.py"))
M, K, N = 32, 16, 8
OPTIONS = ("--backend", "--devices", "--m", "--k", "--n", "--dtype", "--chunks", "--streams", "--warmup", "--repeat",
           "--sets", "--growth-calls", "--steady-calls", "--steady-rounds", "--graph", "--seed", "--json", "--pattern",
           "--no-progress", "--host", "--sweep", "--sweep-m", "--sweep-nk", "--sweep-json")
TINY = ["--backend", "numpy", "--m", str(M), "--k", str(K), "--n", str(N), "--repeat", "2", "--warmup", "1",
        "--growth-calls", "3", "--steady-rounds", "2", "--steady-calls", "3", "--seed", "5"]


@pytest.fixture(scope="module")
def both():
    """One JSON run of both suites at D = 2, two dtypes, S = 1, 2, 4 and 3 (skipped: 3 * 2 does not
    divide M), two stream counts."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(TINY + ["--devices", "2", "--dtype", "float32,float64", "--chunks", "1,2,3,4", "--streams", "1,2",
                            "--pattern", "both", "--json"]) == 0
    return json.loads(out.getvalue())


def ag_expected(dtypes, chunks, streams):
    out = []
    for dt in dtypes:
        out += [("allgather alone", dt, None, None), ("gemm alone (plan)", dt, None, None), ("unpipelined", dt, 1, None)]
        for t in streams:
            for s in chunks:
                out += [("pipelined (eager)", dt, s, t), ("user path (eager)", dt, s, t)]
    return out


def cells(table: str) -> list[dict]:
    """The table read back by its header: plan and dtype left-aligned (dtype never empty), every
    other column right-aligned under its heading (an empty cell is ""), columns one space apart."""
    head, _, *lines = table.splitlines()
    name_w = head.index(" dtype")
    ends = [(m.group(), m.end()) for m in re.finditer(r"\S+", head[name_w + 1:])][1:]  # after dtype
    out = []
    for ln in lines:
        if not ln:
            continue
        rest = ln[name_w + 1:]
        dtype = rest.split(" ", 1)[0]
        row, prev = {"plan": ln[:name_w].strip(), "dtype": dtype}, len(dtype)
        for h, end in ends:
            row[h], prev = rest[prev:end].strip(), end
        out.append(row)
    return out


def test_rows_are_the_variants_asked_for(both):
    rows = [(r["name"], r["dtype"], r["S"], r["streams"]) for r in both["rows"]]
    want = []
    for dt in ("float32", "float64"):
        want += ag_expected([dt], [1, 2, 4], [1, 2])
        want += [("gemm alone (local)", dt, None, None), ("reduce-scatter alone", dt, None, None),
                 ("gemm then reduce-scatter", dt, 1, 2)] + [("gemm+rs pipelined", dt, s, 2) for s in (1, 2, 4)]
    assert rows == want
    # the table has one line per row, in the same order, with the same name, dtype and S
    got = cells(report.table(both["rows"]))
    assert [(c["plan"], c["dtype"], c["S"]) for c in got] == [(n, d, "" if s is None else str(s)) for n, d, s, _ in want]
    # only columns some row fills: NumPy devices have no bare-library ratios
    assert "/cupy-S" not in got[0] and "/cuBLAS-1" not in got[0] and {"ms", "host-us", "rel-err"} <= set(got[0])
    assert all(any(c[h] for c in got) for h in got[0])


def test_json_is_the_same_object_as_before(both):
    """The keys consumers read (BENCHMARKS.md's figures come from them)."""
    assert set(both) == {"env", "args", "rows", "memory"}
    assert set(both["env"]) == {"date", "python", "numpy", "backend", "mesh", "nprocs", "host", "user_arrays"}
    assert both["env"]["backend"] == "numpy" and both["env"]["user_arrays"] == "numpy"
    assert set(both["args"]) == {o[2:].replace("-", "_") for o in OPTIONS}
    base = {"name", "dtype", "S", "streams", "ms", "ms_min", "ms_max", "tflops", "host_us", "host_frac", "rel_err"}
    ag = base | {"host_us_steady", "ms_steady", "host_frac_steady"}
    keys = {
        "allgather alone": ag | {"gb_s"}, "gemm alone (plan)": ag, "unpipelined": ag,
        "pipelined (eager)": ag | {"overlap_eff"},
        "user path (eager)": ag | {"overlap_eff", "vs_plan_alone", "vs_plan_alone_steady"},
        "gemm alone (local)": base, "reduce-scatter alone": base,
        "gemm then reduce-scatter": base | {"overlap_eff", "speedup_vs_unpipelined"},
        "gemm+rs pipelined": base | {"overlap_eff", "speedup_vs_unpipelined"},
    }
    for r in both["rows"]:
        assert set(r) == keys[r["name"]], r["name"]
    assert both["memory"] == []  # growth and footprint need a device clock


def test_every_result_is_checked_and_within_tolerance(both):
    for r in both["rows"]:
        if r["name"] in ("allgather alone", "gemm alone (local)", "reduce-scatter alone"):
            assert r["rel_err"] is None  # nothing to hold against A @ B
        else:
            assert r["rel_err"] is not None and r["rel_err"] <= cli.TOLERANCE[r["dtype"]], r


def test_ratios_agree_with_the_rows_they_come_from(both):
    rows = both["rows"]
    for dt in ("float32", "float64"):
        by = [r for r in rows if r["dtype"] == dt]
        ms = {r["name"]: r["ms"] for r in by if r["S"] is None}
        flat = next(r["ms"] for r in by if r["name"] == "gemm then reduce-scatter")
        for i, r in enumerate(by):
            assert r["host_frac"] == pytest.approx(r["host_us"] * 1e-3 / r["ms"])
            assert r["ms_min"] <= r["ms"] <= r["ms_max"]
            if r["name"] in ("pipelined (eager)", "user path (eager)"):
                assert r["overlap_eff"] == pytest.approx(max(ms["allgather alone"], ms["gemm alone (plan)"]) / r["ms"])
                assert r["tflops"] == pytest.approx(2 * M * N * K / (r["ms"] * 1e-3) / 1e12)
            if r["name"] == "user path (eager)":  # against the plan alone: the row before it
                alone = by[i - 1]
                assert (alone["name"], alone["S"], alone["streams"]) == ("pipelined (eager)", r["S"], r["streams"])
                assert r["vs_plan_alone"] == pytest.approx(r["ms"] / alone["ms"])
            if r["name"] == "gemm+rs pipelined":
                t = max(ms["gemm alone (local)"], ms["reduce-scatter alone"])
                assert r["overlap_eff"] == pytest.approx(t / r["ms"])
                assert r["speedup_vs_unpipelined"] == pytest.approx(flat / r["ms"])
                assert r["tflops"] == pytest.approx(2 * M * N * K / 2 / (r["ms"] * 1e-3) / 1e12)


def test_results_over_tolerance_fail_the_run(monkeypatch, capsys):
    monkeypatch.setattr(cli, "TOLERANCE", {"float32": -1.0})  # every checked result is now "over"
    assert main(TINY + ["--devices", "1", "--dtype", "float32", "--chunks", "1", "--streams", "1", "--json"]) == 1
    out = capsys.readouterr()
    checked = [r for r in json.loads(out.out)["rows"] if r["rel_err"] is not None]
    assert len(checked) == 4  # gemm alone, unpipelined, pipelined, user path
    assert f"shardfuse bench: {len(checked)} result(s) over tolerance" in out.err


def test_rel_err_sees_a_wrong_result():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 4))
    assert rel_err(ref.reshape(2, 3, 4), ref) == 0.0  # any shape in row order
    assert rel_err(ref * 1.001, ref) == pytest.approx(1e-3)
    assert rel_err(ref[::-1], ref) > 0.5  # rows out of order
    # bfloat16 as CuPy holds it (its uint16 bits) reads as the same numbers as ml_dtypes' bfloat16
    pytest.importorskip("ml_dtypes")
    bf = ref.astype(np_dtype("bfloat16"))
    assert np.array_equal(f64(bf.view(np.uint16)), bf.astype(np.float64))
    assert 0 < rel_err(bf.view(np.uint16), ref) < cli.TOLERANCE["bfloat16"]


def test_the_table_through_the_command_line():
    """`python -m shardfuse bench` on one device: the table (not JSON), one line per variant."""
    r = subprocess.run([sys.executable, "-m", "shardfuse", "bench", *TINY, "--devices", "1", "--dtype", "float32",
                        "--chunks", "1,2", "--streams", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("plan "))
    want = [n for n, *_ in ag_expected(["float32"], [1, 2], [2])]
    assert lines[-1] == ""  # an empty memory table (no device clock)
    got = cells("\n".join(lines[head:-1]))
    assert [c["plan"] for c in got] == want
    errs = [c["rel-err"] for c in got[1:]]  # every row but the Allgather alone has its error
    assert all(float(e) <= cli.TOLERANCE["float32"] for e in errs), errs
    # progress on stderr (not a terminal here: a line as each phase starts and ends), none with --no-progress
    assert "idle rounds" in r.stderr and "back to back" in r.stderr and "done in" in r.stderr
    quiet = subprocess.run([sys.executable, "-m", "shardfuse", "bench", *TINY, "--devices", "1", "--chunks", "1",
                            "--no-progress"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_host_table_times_every_case_asked_for(capsys):
    """--host: one row per (D, S), eager only on NumPy devices, the plan alone and the user path,
    with the steps a call issues (S GEMMs and S all-gathers at D = 2) and the bare GEMM beside."""
    assert main(["--host", "--backend", "numpy", "--devices", "2", "--chunks", "1,3", "--steady-calls", "2",
                 "--steady-rounds", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = got["host"]["rows"]
    assert [(r["D"], r["S"], r["steps"]) for r in rows] == [(2, 1, 2), (2, 3, 6)]
    assert all(r[k] > 0 for r in rows for k in ("eager", "eager_natural", "eager_user")) and "graph" not in rows[0]
    assert list(got["host"]["baselines"]) == ["numpy.matmul"] and got["env"]["backend"] == "numpy"
    text = host.table(got["host"])
    assert text.splitlines()[1].split() == ["D", "S", "eager", "eager_natural", "eager_user", "eager/dev-step"]
    assert [ln.split()[:2] for ln in text.splitlines()[3:5]] == [["2", "1"], ["2", "3"]]
    with pytest.raises(SystemExit):
        main(["--host", "--backend", "numpy", "--steady-calls", "0"])


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardfuse bench")
    assert set(re.findall(r"^  (--[a-z-]+)", out, re.M)) == set(OPTIONS)  # and -h, --help
    assert "time AllGather+GEMM plans against their parts" in out  # the description is the old docstring


# ---- the one timing loop ------------------------------------------------------------------------
def numpy_clock():
    backend = backend_of(sf.DeviceMesh(1, backend="numpy"))
    assert not device_streams(backend)
    return HostClock(backend)


def counted(name, log, busy_ms=0.0, took=None):
    """A variant that logs (name, r) for every call it makes, busy for busy_ms each (and appends
    the ms each call took to `took`)."""
    st = {"r": None}

    def fn():
        log.append((name, st["r"]))
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < busy_ms:
            pass
        if took is not None:
            took.append((time.perf_counter() - t0) * 1e3)

    def before(r):
        st["r"] = r
    return runner.Variant(name, fn, before)


def test_idle_rounds_call_each_variant_once_a_round():
    log, clock = [], numpy_clock()
    a, b = counted("a", log), counted("b", log)
    runner.idle_rounds(clock, [a, b], warmup=2, repeat=3)
    assert log == [(v, r) for r in range(5) for v in "ab"]  # round robin; round r uses input set r
    assert len(a.gpu) == len(a.host) == len(b.gpu) == 3  # the warm-up is dropped


def test_back_to_back_runs_call_each_variant_calls_times_a_run():
    log, clock = [], numpy_clock()
    a, b = counted("a", log), counted("b", log)
    runner.back_to_back(clock, [a, b], calls=4, rounds=2)
    run = [(v, r) for v in "ab" for r in range(4)]
    assert log == run + run
    assert len(a.host_b2b) == 8 and len(a.gpu_b2b) == 2  # host time per call, GPU time per call per run
    runner.back_to_back(clock, [a], calls=0, rounds=2)
    assert len(log) == 16


def test_alternating_pairs_call_first_then_second_fenced():
    log, clock = [], numpy_clock()
    a, b = counted("a", log), counted("b", log)
    b.fenced_fn = lambda: log.append(("b fenced", None))  # alternating calls the fenced form
    runner.alternating(clock, a, b, pairs=3)
    assert log == [("a", 0), ("b fenced", None), ("a", 1), ("b fenced", None), ("a", 2), ("b fenced", None)]


def test_the_loop_times_what_it_calls():
    """Each stamped interval holds its call (wall time on the host clock; calls busy-wait, and
    what each took is recorded, since a loaded machine stretches them)."""
    log, clock, ta, tb = [], numpy_clock(), [], []
    a, b = counted("a", log, 1.0, ta), counted("b", log, 4.0, tb)
    runner.idle_rounds(clock, [a, b], warmup=0, repeat=2)
    assert all(g >= t for g, t in zip(a.gpu, ta)) and all(g >= t for g, t in zip(b.gpu, tb))
    assert all(g * 1e3 >= h >= t * 1e3 for g, h, t in zip(b.gpu, b.host, tb))  # ms, us: the call inside its stamps
    del tb[:]
    runner.back_to_back(clock, [b], calls=3, rounds=1)
    assert b.gpu_b2b[0] * 3 >= sum(tb) and 0.75 < b.gpu_b2b[0] / np.mean(tb) < 1.33  # per call
    del ta[:], tb[:]
    ratio = runner.alternating(clock, a, b, pairs=5)  # second over first, not the inverse
    assert 0.75 < ratio / (np.median(tb) / np.median(ta)) < 1.33


# ---- memory -------------------------------------------------------------------------------------
class CountingClock(HostClock):
    """Host clock that reads 'device memory' from a real store the variants fill."""

    def __init__(self, backend, store):
        super().__init__(backend)
        self.store = store

    def memory(self):
        held = sum(len(x) for x in self.store)
        return held, 2 * held


def test_growth_counts_the_bytes_of_the_asked_calls():
    store, log = [], []
    clock = CountingClock(numpy_clock().backend, store)
    leak = counted("leak", log)
    fn = leak.fn
    leak.fn = lambda: (fn(), store.append(bytes(64)))
    rec = memory.growth(clock, leak, 7)
    assert rec == {"growth_calls": 7, "pool_growth_bytes": 7 * 64, "device_growth_bytes": 2 * 7 * 64}
    assert len(log) == 3 + 7  # 3 warm-up calls, then the 7 counted
    assert memory.growth(clock, counted("tight", log), 5)["pool_growth_bytes"] == 0
    assert memory.growth(numpy_clock(), leak, 5) is None  # no device memory to read


def test_footprint_bound_is_the_bytes_placed():
    mesh = sf.DeviceMesh(2, backend="numpy")
    inputs = Inputs(mesh, M, K, N, "float32", 1, 0)
    s, nstreams = 2, 4
    a, b = inputs.a_array(0, s), inputs.b_array(0)
    pipelined, _ = seed_functions(mesh, nstreams)
    c = pipelined(a, b)
    rec = memory.bound(M, K, N, mesh, "float32", s, nstreams, 1, backend_of(mesh).memory_stats())
    assert rec["inputs_bytes"] == sum(sh.data.nbytes for x in (a, b) for sh in x.addressable_shards)
    assert rec["outputs_bytes"] == sum(sh.data.nbytes for sh in c.addressable_shards)
    assert rec["cublas_workspace_bytes"] == 0
    assert rec["bound_bytes"] == rec["inputs_bytes"] + rec["outputs_bytes"] + rec["gathered_a_bytes"]
    assert all(type(v) is int for v in rec.values())
    # per GPU, one workspace per handle for the main stream and each worker stream the plan uses
    ws = memory.bound(M, K, N, mesh, "float32", s, nstreams, 2, {"workspace_bytes": 5 * 1024, "handles": 5})
    assert ws["cublas_workspace_bytes"] == 2 * 1024 * min(1 + nstreams, 1 + s)


# ---- the package itself ---------------------------------------------------------------------------
def test_bench_keeps_to_the_protocol_and_the_public_api():
    """No private name of another object, no private constructor (issue 8: what the bench times
    is what users run), and nothing read from a backend outside `protocol.Backend`."""
    members = {n for n in dir(Backend) if not n.startswith("_")} | set(Backend.__annotations__)
    not_yet = {"stream"}  # the main stream a bare cuBLAS baseline is stamped on (baselines.py)
    for path in BENCH + sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                assert name not in ("Array", "Layout", "to_device", "replicated"), f"{path.name}:{node.lineno}"
            if path.parent.name != "bench":
                continue
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                assert isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"), \
                    f"{path.name}:{node.lineno}: {ast.unparse(node)}"
            if isinstance(node, ast.ImportFrom):
                assert not any(a.name.startswith("_") for a in node.names), f"{path.name}:{node.lineno}"
            if isinstance(node, ast.Attribute) and (
                    isinstance(node.value, ast.Name) and node.value.id in ("be", "backend")
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "backend"):
                assert node.attr in members | not_yet, f"{path.name}:{node.lineno}: backend.{node.attr}"


def test_bench_files_and_functions_are_small():
    for path in BENCH:
        text = path.read_text()
        assert text.count("\n") <= 400, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}: {node.name}"
