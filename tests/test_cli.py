"""The console entry points a new user runs first."""
import subprocess
import sys

import pytest

from shardfuse.cli import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "shardfuse", *args], capture_output=True, text=True, timeout=120)


def test_demo_runs_checks_and_times():
    r = run("demo", "--backend", "numpy", "--devices", "4", "--chunks", "4", "--m", "128", "--k", "16",
            "--n", "16", "--repeat", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "For i in range(4):" in out and "Allgather" in out
    assert "-> OK" in out
    assert "collectives per call: pipelined {'allgather': 4}, unpipelined {'allgather': 1}" in out
    assert "pipelined" in out and "unpipelined" in out and " ms" in out
    assert "a(4, 4, 8, 16) @ b(16, 16) float32 (M=128 rows of A" in out  # --m is M, as in bench and simulate


@pytest.mark.parametrize("extra, case, collectives", [
    ((), "seed", {"pipelined": {"allgather": 2}, "unpipelined": {"allgather": 1}}),
    (("--mlp", "sp", "--hidden", "8"), "mlp sp",
     {"pipelined": {"allgather": 2, "reduce_scatter": 2}, "unpipelined": {"allgather": 1, "reduce_scatter": 1}}),
])
def test_demo_json_is_one_object(extra, case, collectives):
    import json

    r = run("demo", "--backend", "numpy", "--devices", "2", "--chunks", "2", "--m", "16", "--k", "8", "--n", "8",
            "--repeat", "2", "--seed", "7", "--json", *extra)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # the whole of stdout: one JSON object, no text beside it
    assert out["case"] == case and out["collectives"] == collectives
    assert out["seed"] == 7 and out["passed"] is True and 0 <= out["relative_error"] <= out["tolerance"]
    assert (out["backend"], out["devices"], out["processes"], out["virtual"], out["repeat"]) == ("numpy", 2, 1, True, 2)
    assert out["plan"].startswith("plan ") and "For i in range(2):" in out["plan"]
    assert set(out["timings_ms"]) == {"pipelined", "unpipelined"} and all(t > 0 for t in out["timings_ms"].values())


def test_demo_help_lists_options():
    r = run("demo", "--help")
    assert r.returncode == 0
    for opt in ("--chunks", "--streams", "--dtype", "--devices", "--m", "--k", "--n", "--json"):
        assert opt in r.stdout


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_demo_mlp_sequence_parallel():
    r = run("demo", "--mlp", "sp", "--backend", "numpy", "--devices", "2", "--chunks", "2", "--m", "16",
            "--hidden", "8", "--repeat", "1")
    assert r.returncode == 0, r.stderr
    assert "MLP block (sp), x[16, 8]" in r.stdout and "-> OK" in r.stdout
    assert "chunks=2 {'allgather': 2, 'reduce_scatter': 2}" in r.stdout


@pytest.mark.parametrize("argv, message", [
    (["demo", "--devices", "0"], "--devices must be a positive int, got 0"),
    (["demo", "--streams", "-2"], "--streams must be a positive int, got -2"),
    (["demo", "--devices", "3", "--m", "5", "--chunks", "0"], "--chunks must be a positive int, got 0"),
    (["profile", "--m", "0"], "--m must be a positive int, got 0"),
    (["profile", "--devices", "2", "--m", "12"], "12 must be a multiple of --chunks x devices = 4 x 2 = 8"),
    (["demo", "--backend", "numpy", "--seed", "-1"], "--seed must be an int >= 0, got -1"),
    (["demo", "--backend", "numpy", "--devices", "2", "--m", "100000000000"], "do not fit this machine's memory"),
    (["demo", "--backend", "numpy", "--devices", "2", "--chunks", "4", "--m", "12"],
     "--m is M, all of A's rows (as in shardfuse bench and simulate; demo's and profile's --m once meant rows per device per "
     "chunk): 12 must be a multiple of --chunks x devices = 4 x 2 = 8"),
    (["bench", "--backend", "numpy", "--devices", "3"], "--m must be a multiple of D = 3"),
    (["bench", "--backend", "numpy", "--dtype", "float32,float8"], "--dtype takes float64, float32, float16, bfloat16"),
    (["bench", "--backend", "numpy", "--graph"], "--graph times CUDA graph replay: it needs the cupy backend"),
    (["bench", "--backend", "numpy", "--chunks", "0"], "--chunks must be positive ints"),
    (["profile", "--png", ""], "argument --png: an empty file name"),
    (["profile", "--trace", "{file}/t.json"], "/a_file is not a directory"),
    (["bench", "--sweep", "--backend", "numpy", "--devices", "3", "--sweep-m", "12,13"],
     "--sweep-m values must be multiples of D = 3, got [12, 13]"),
])
def test_cli_mistakes_are_one_line_and_exit_2(argv, message, tmp_path):
    (tmp_path / "a_file").write_text("")
    r = run(*[a.format(file=tmp_path / "a_file") for a in argv])
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_errors_from_the_library_are_one_line_unless_debug():
    bad = ["demo", "--devices", "3", "--backend", "numpy", "--mlp", "tp", "--hidden", "5", "--m", "12", "--chunks", "1"]
    r = run(*bad)  # 4 * hidden = 20 does not divide over 3 devices
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("shardfuse demo: error: cannot shard axis 1 of extent 20 of w1[5, 20] (an argument) "
                                "over DIDx: the mesh axis has 3 devices, which does not divide 20 (shards are even: "
                                "pad the axis to 21, as Megatron pads a vocabulary, or shard another axis)")
    d = run("--debug", *bad)
    assert d.returncode != 0 and "Traceback" in d.stderr and "ValueError: cannot shard axis 1" in d.stderr


def test_demo_prints_its_seed_and_what_its_times_mean():
    r = run("demo", "--backend", "numpy", "--devices", "2", "--chunks", "2", "--m", "16", "--k", "8", "--n", "8",
            "--repeat", "1", "--seed", "123")
    assert r.returncode == 0, r.stderr
    assert "inputs from seed 123 (repeat with --seed 123)" in r.stdout
    assert "2 NumPy devices of one process run one after another" in r.stdout
    again = run("demo", "--backend", "numpy", "--devices", "2", "--chunks", "2", "--m", "16", "--k", "8", "--n", "8",
                "--repeat", "1", "--seed", "123")
    error = [line for line in r.stdout.splitlines() if "relative error" in line]
    assert error and error == [line for line in again.stdout.splitlines() if "relative error" in line]  # same inputs


def test_bench_defaults_are_sized_to_the_backend_and_numbers_are_checked():
    import json

    r = run("bench", "--backend", "numpy", "--devices", "2", "--json", "--repeat", "2", "--steady-rounds", "1")
    assert r.returncode == 0, r.stderr
    args = json.loads(r.stdout)["args"]
    assert (args["m"], args["k"], args["n"], args["dtype"], args["chunks"]) == (512, 512, 512, "float32", [1, 2, 4])
    bad = run("bench", "--backend", "numpy", "--devices", "2", "--m", "0")
    assert bad.returncode == 2 and "--m must be a positive int, got 0" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("args", [["profile", "--png", "{missing}/x.png"], ["profile", "--trace", "{missing}/t.json"],
                                  ["simulate", "--png", "{missing}/a.png"], ["simulate", "--trace", "{tmp}"],
                                  ["profile", "--devices", "0"]])
def test_outputs_that_cannot_be_written_and_bad_sizes_fail_before_any_work(args, tmp_path, capsys):
    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "does not exist" in err or "is a directory" in err or "--devices must be a positive int, got 0" in err
    assert "Traceback" not in err


def test_calibrate_refuses_a_cache_it_cannot_write_before_measuring(tmp_path):
    import os

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "shardfuse", "calibrate", "--backend", "numpy", "--force"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "SHARDFUSE_CACHE_DIR": str(blocker)})
    assert r.returncode == 2 and "is not a writable directory (set SHARDFUSE_CACHE_DIR to one)" in r.stderr, r.stderr
    assert "calibrating" not in r.stdout  # refused before any measurement


def test_simulate_prints_the_overlap_efficiency_its_chart_shows(tmp_path, capsys, monkeypatch):
    # at small sizes the host's time per call outside the steps is a large part of the predicted
    # total: the line said 0.28 (over the call) while the chart's title said 0.50 (over the steps)
    import re

    from shardfuse.timeline import Timeline

    titles, plot = [], Timeline.plot
    monkeypatch.setattr(Timeline, "plot", lambda self, *a, **k: titles.append(plot(self, *a, **k).axes[0].get_title()))
    argv = ["simulate", "--devices", "2", "--m", "1024", "--k", "1024", "--n", "1024", "--png", str(tmp_path / "s.png")]
    assert main(argv) == 0
    printed = re.search(r"overlap efficiency (\d\.\d\d) over the steps' span", capsys.readouterr().out).group(1)
    assert len(titles) == 1 and titles[0].startswith(f"ag_gemm: {printed} overlap efficiency, ")
    assert re.search(r"overlap efficiency, (\d+% of communication hidden|no communication)$", titles[0]), titles


def test_simulate_help_names_no_issue_and_no_path_outside_the_project(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert "issue" not in out.lower() and "../" not in out and "MULTIGPU" not in out
    assert "M, all of A's rows, as in shardfuse demo and bench" in " ".join(out.split())
