"""`shardfuse bench` on the NumPy backend (tiny sizes): it runs, checks its results (the user path's
too: NumPy arrays in through the public API, to_local() out), --json parses."""
import json
import subprocess
import sys

from shardfuse.bench import main, table


def run(*args):
    return subprocess.run([sys.executable, "-m", "shardfuse", "bench", *args], capture_output=True, text=True,
                          timeout=120)


TINY = ["--backend", "numpy", "--m", "32", "--k", "16", "--n", "8", "--chunks", "1,2,4", "--streams", "1,2",
        "--repeat", "2", "--warmup", "1", "--growth-calls", "3", "--steady-rounds", "2"]


def test_bench_json_parses():
    r = run(*TINY, "--devices", "2", "--dtype", "float32,float64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["env"]["backend"] == "numpy"
    rows = out["rows"]
    names = [row["name"] for row in rows]
    for want in ("allgather alone", "gemm alone (plan)", "unpipelined", "pipelined (eager)", "user path (eager)"):
        assert want in names
    want = {(s, t, d) for s in (1, 2, 4) for t in (1, 2) for d in ("float32", "float64")}
    pipe = [row for row in rows if row["name"] == "pipelined (eager)"]
    user = [row for row in rows if row["name"] == "user path (eager)"]
    assert {(row["S"], row["streams"], row["dtype"]) for row in pipe} == want
    assert {(row["S"], row["streams"], row["dtype"]) for row in user} == want
    for row in rows:
        assert row["ms"] > 0 and row["host_us"] > 0
        assert row["tflops"] is None if row["name"] == "allgather alone" else row["tflops"] > 0
    assert all(row["overlap_eff"] > 0 for row in pipe)
    # every plan's result is checked at D = 2 too (the inputs are global arrays)
    for row in rows:
        if row["name"] != "allgather alone":
            assert row["rel_err"] < (1e-5 if row["dtype"] == "float32" else 1e-12), row
    assert all(row["vs_plan_alone"] > 0 and row["vs_plan_alone_steady"] > 0 and row["ms_steady"] > 0 for row in user)
    assert out["env"]["user_arrays"] == "numpy"


def test_bench_table_checks_results_on_one_device():
    r = run(*TINY, "--devices", "1", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert "pipelined (eager)" in r.stdout and "TFLOP/s" in r.stdout
    assert "user path (eager)" in r.stdout and "/plan" in r.stdout
    assert "rel err" in r.stdout


def test_bench_main_in_process(capsys):
    assert main(TINY + ["--devices", "1", "--dtype", "float32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert table(out["rows"]).count("pipelined (eager)") == 6
    assert table(out["rows"]).count("user path (eager)") == 6
    errs = [row["rel_err"] for row in out["rows"] if row["rel_err"] is not None]
    assert errs and max(errs) < 1e-4
    user = [row for row in out["rows"] if row["name"] == "user path (eager)"]
    assert all(row["rel_err"] is not None and row["rel_err"] < 1e-4 for row in user)


def test_bench_gemm_reduce_scatter_json():
    r = run(*TINY, "--devices", "4", "--dtype", "float64", "--pattern", "rs", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    names = [row["name"] for row in rows]
    assert names[:3] == ["gemm alone (local)", "reduce-scatter alone", "gemm then reduce-scatter"]
    pipe = [row for row in rows if row["name"] == "gemm+rs pipelined"]
    assert [row["S"] for row in pipe] == [1, 2, 4]
    for row in pipe + [rows[2]]:
        assert row["rel_err"] < 1e-12 and row["ms"] > 0 and row["overlap_eff"] > 0


def test_benchmarks_build_arrays_only_through_the_public_api():
    """Issue 8: what the benchmarks time is what users run, so no private constructor."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in [root / "shardfuse" / "bench.py", *sorted((root / "benchmarks").glob("*.py"))]:
        text = path.read_text()
        for private in ("sf.Array(", " Array(", "import Array", "Layout(", "Layout.replicated", "to_device("):
            assert private not in text, f"{path.name} uses {private!r}"
