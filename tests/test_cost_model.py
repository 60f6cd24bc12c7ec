"""The cost model, chunks="auto", calibration and its cache, the simulator (issue 15).  CPU only."""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import shardfuse as sf
from shardfuse import calibrate, cost, rates
from shardfuse.cli import main as cli
from shardfuse.layout import Layout
from shardfuse.ops import Op

ROWS = Layout(("DIDx", None))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFUSE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def seed(mesh, chunks, streams=2, algorithm="collective", **kw):
    def ag_gemm(a, b):
        return sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=chunks, algorithm=algorithm)
    return sf.jit(ag_gemm, mesh=mesh, streams=streams, **kw)


def specs(m, k, n, dtype="float64"):
    return sf.TensorSpec((m, k), dtype, ROWS), sf.TensorSpec((k, n), dtype)


def gpu_like(**changes):
    """Round, overlapping (non-serial) rates to inject."""
    base = dict(name="injected", gemm_flops={"float64": 1e9}, gemm_half_flops=0.0, mem_bw=1e12, gemm_bw=1e12,
                comm_bw={op: 1e9 for op in cost.BUS_FACTOR}, comm_latency_s=0.0, comm_step_latency_s=0.0,
                step_s=1e-9, comm_step_s=1e-9, event_s=0.0, call_s=0.0, gemm_slowdown=1.0, serial=False)
    return cost.Rates(**{**base, **changes})


# ---- the model against figures computed by hand ------------------------------------------------------
# D = 2, A [8, 4] sharded on rows, B [4, 2], float64.  Per chunk (S = 2) a device gathers 16 elements
# (128 bytes): 1 ms + 128 x (1/2) / 1e6 s = 1.064 ms; its GEMM is 2 x 8 x 4 = 64 FLOP: 64 us.  Host:
# Allgather steps 200 us, GEMM steps 100 us, events free: AG0 issued at 0.2 ms, GEMM0 at 0.3, AG1 at 0.5,
# GEMM1 at 0.6.  AG0 runs 0.2 -> 1.264; then GEMM0 and AG1 start together, GEMM0 at half speed beside
# it (slowdown 2): 1.264 -> 1.392; AG1 1.264 -> 2.328; GEMM1 2.328 -> 2.392; + 0.5 ms per call = 2.892 ms.
# S = 1: one Allgather of 256 bytes, 1.128 ms from 0.2; one GEMM of 128 FLOP, 128 us: 1.456 + 0.5 = 1.956.
# Serial (as NumPy devices run): every step after the previous, its host time first: S = 2 is
# 0.5 + 2 x (0.2 + 1.064 + 0.1 + 0.064) = 3.356 ms.
HAND = gpu_like(gemm_flops={"float64": 1e6}, comm_bw={op: 1e6 for op in cost.BUS_FACTOR}, comm_latency_s=1e-3,
                step_s=1e-4, comm_step_s=2e-4, call_s=0.5e-3, gemm_slowdown=2.0)


def test_prediction_equals_hand_computed_figures():
    mesh = sf.DeviceMesh(2, backend="numpy")
    two, one = (seed(mesh, s).lower(*specs(8, 4, 2)).program for s in (2, 1))
    p2 = cost.predict(two, HAND)
    assert p2.total_s == pytest.approx(2.892e-3, rel=1e-12)
    gemms = [t for e in p2.events if e.kind == "gemm" for t in (e.start, e.end)]
    comms = [t for e in p2.events if e.kind == "communication" and not e.text.startswith("Wait") for t in (e.start, e.end)]
    assert gemms == pytest.approx([1.264e-3, 1.392e-3, 2.328e-3, 2.392e-3], rel=1e-12)
    assert comms == pytest.approx([0.2e-3, 1.264e-3, 1.264e-3, 2.328e-3], rel=1e-12)
    s = p2.summary()
    assert s["communication_s"] == pytest.approx(2.128e-3) and s["exposed_communication_s"] == pytest.approx(2.0e-3)
    assert cost.predict(one, HAND).total_s == pytest.approx(1.956e-3, rel=1e-12)
    assert cost.predict(two, replace(HAND, serial=True)).total_s == pytest.approx(3.356e-3, rel=1e-12)
    plan = seed(mesh, "auto", rates=HAND).lower(*specs(8, 4, 2))  # the latency makes chunks cost more
    assert plan.explain().chosen == 1 and [c.s for c in plan.explain().candidates] == [1, 2, 4, 8]
    assert rates.engines(mesh) == (2, 2)  # NumPy devices as they run: one host, one engine
    # but a GPU's rates on NumPy devices predict one GPU per device, each in its own process (as
    # `shardfuse simulate`): not D devices sharing one engine, where nothing could overlap
    assert rates.machine(mesh, HAND) == (HAND, 1, 1) and rates.machine(mesh, cost.CPU) == (cost.CPU, 2, 2)
    assert plan.explain().candidates[1].total_s == p2.total_s < cost.predict(two, HAND, 2, 2).total_s


def test_a_gemm_of_few_rows_is_bound_by_streaming_its_operands():
    # A [2, 4] @ B [4, 2], float64: 2 x 2 x 2 x 4 = 32 FLOP, (8 + 8 + 4) x 8 = 160 bytes.  At 1 MFLOP/s
    # and 1 MB/s the FLOPs take 32 us and the bytes 160 us: the larger figure dominates the smoothed
    # roofline (their 3-norm, 160.4 us); at 1 GB/s the bytes take 0.16 us and the FLOPs are all.
    mesh = sf.DeviceMesh(1, backend="numpy")
    prog = sf.jit(lambda a, b: a @ b, mesh=mesh).lower(sf.TensorSpec((2, 4), "float64"),
                                                         sf.TensorSpec((4, 2), "float64")).program
    gemm = next(i for i in prog.walk() if i.op == Op.MATMUL)
    slow, fast = (gpu_like(gemm_flops={"float64": 1e6}, gemm_bw=bw) for bw in (1e6, 1e9))
    assert cost.work_of(gemm, mesh, slow) == ("compute", pytest.approx((32.0 ** 3 + 160.0 ** 3) ** (1 / 3) * 1e-6))
    assert cost.work_of(gemm, mesh, fast) == ("compute", pytest.approx(32e-6))


def test_collectives_of_devices_sharing_a_gpu_queue_with_its_gemms():
    # Virtual devices of one GPU (share > 1): their collectives are copies on the same SMs and HBM,
    # so the model runs them on the compute engine; one device per GPU overlaps them.
    mesh = sf.DeviceMesh(2, backend="numpy")
    prog = seed(mesh, 2, rates=HAND).lower(*specs(8, 4, 2)).program
    gather = next(i for i in prog.walk() if i.op == Op.ALLGATHER)
    gpu = gpu_like()
    assert cost.work_of(gather, mesh, gpu, share=1)[0] == "comm"
    assert cost.work_of(gather, mesh, gpu, share=2)[0] == "compute"
    assert cost.work_of(gather, mesh, gpu, share=1)[1] == cost.work_of(gather, mesh, gpu, share=2)[1]
    overlapped, queued = (cost.predict(prog, gpu, 2, share).summary() for share in (1, 2))
    assert queued["exposed_communication_s"] == pytest.approx(queued["communication_s"])
    assert overlapped["exposed_communication_s"] < overlapped["communication_s"]


def test_a_prediction_is_a_timeline():
    mesh = sf.DeviceMesh(2, backend="numpy")
    pred = seed(mesh, 2, rates=HAND).lower(*specs(8, 4, 2)).predict()
    tl = pred.timeline()
    assert len(tl) == 11 and {e.stream for e in tl.events} == {"main", "0", "1"}  # every plan step, Waits too
    assert any("Allgather" in e.text and "[i=1]" in e.text for e in tl.events)
    trace = tl.to_chrome_trace()["traceEvents"]
    assert len([e for e in trace if e["ph"] == "X"]) == 2 * 11  # each step on each device's track
    assert {e["args"]["name"] for e in trace if e["name"] == "process_name"} == {"rank 0 device 0", "rank 0 device 1"}


def test_calibration_fits_one_figure_to_a_measured_time_either_way():
    # calibrate.fit_to bisects a figure until the model's time of a plan is the measured one: the
    # collective latency (the time grows with it) and gemm_bw (the time shrinks as it grows), here
    # from a time the model gave with known figures; a time out of reach ends at the bound.
    mesh = sf.DeviceMesh(2, backend="numpy")
    prog = seed(mesh, 4).lower(*specs(64, 32, 16)).program
    truth = gpu_like(comm_latency_s=3e-5, gemm_bw=2e9, gemm_flops={"float64": 1e12})
    t = cost.predict(prog, truth, 2, 2).total_s
    lat = calibrate.fit_to(prog, t, replace(truth, comm_latency_s=0.0), "comm_latency_s", 0.0, 1e-3, 2, 2)
    assert lat.comm_latency_s == pytest.approx(3e-5, rel=1e-6)
    bw = calibrate.fit_to(prog, t, replace(truth, gemm_bw=5e9), "gemm_bw", 2e8, 1e10, 2, 2)
    assert bw.gemm_bw == pytest.approx(2e9, rel=1e-6)
    assert calibrate.fit_to(prog, t / 100, truth, "comm_latency_s", 0.0, 1e-3, 2, 2).comm_latency_s < 1e-9


def test_the_pipelined_runs_of_calibration_have_the_b_shapes_asked_for():
    # calibrate's shared-GPU runs take the sweep's B shapes, [K, N] with K != N too (SHARED_RUNS)
    mesh = sf.DeviceMesh(2, backend="numpy")
    prog, t = calibrate.pipelined_run(mesh, lambda fn: (fn(), 0.5)[1], 64, 16, 48, 4)
    assert [v.type.shape for v in prog.inputs] == [(64, 48), (48, 16)] and t == 0.5


def test_calibration_fits_two_figures_to_several_runs_at_once():
    # calibrate.fit_least_squares, as on devices sharing a GPU: the collective latency and gemm_bw
    # from pipelined runs at two B sizes and S = 1, 2, 4 (GEMMs bound by streaming B), timed by the
    # model with known figures; started far from them.
    mesh = sf.DeviceMesh(2, backend="numpy")
    truth = gpu_like(comm_latency_s=3e-5, gemm_bw=2e9, gemm_flops={"float64": 1e12})
    progs = [seed(mesh, s).lower(*specs(64, n, n)).program for n in (32, 64) for s in (1, 2, 4)]
    runs = [(p, cost.predict(p, truth, 2, 2).total_s) for p in progs]
    start = replace(truth, comm_latency_s=0.0, gemm_bw=8e9)
    bounds = {"comm_latency_s": (0.0, 3e-4), "gemm_bw": (1e9, 1.6e10)}
    fit = calibrate.fit_least_squares(runs, start, bounds, 2, 2)
    assert fit.comm_latency_s == pytest.approx(3e-5, rel=0.02) and fit.gemm_bw == pytest.approx(2e9, rel=0.02)
    # one run 10% slow (noise) moves the figures a little, to no bound
    noisy = calibrate.fit_least_squares([(p, t * (1.1 if i == 5 else 1)) for i, (p, t) in enumerate(runs)],
                                        start, bounds, 2, 2)
    assert 1e-5 < noisy.comm_latency_s < 1e-4 and 1.2e9 < noisy.gemm_bw < 4e9


# ---- chunks="auto" -----------------------------------------------------------------------------
def test_auto_is_1_where_overlap_cannot_pay():
    one = sf.DeviceMesh(1, backend="numpy")  # one device: no communication at all
    for r in (None, "h200"):
        plan = seed(one, "auto", rates=r).lower(*specs(64, 16, 8))
        assert plan.explain().chosen == 1 and plan.collectives() == {}
    assert "no communication to hide" in str(seed(one, "auto", rates="h200").lower(*specs(64, 16, 8)).explain())
    mesh = sf.DeviceMesh(4, backend="numpy")
    free_comm = gpu_like(comm_bw={op: 1e30 for op in cost.BUS_FACTOR})
    costly_steps = gpu_like(gemm_flops={"float64": 1e12}, comm_bw={op: 1e8 for op in cost.BUS_FACTOR}, step_s=1.0)
    for r in (free_comm, costly_steps, None):  # None: the NumPy defaults, steps one after another
        assert seed(mesh, "auto", rates=r).lower(*specs(64, 16, 8)).explain().chosen == 1


def test_auto_pipelines_when_communication_dominates_and_computes_right(monkeypatch):
    mesh = sf.DeviceMesh(4, backend="numpy")
    # predicted as one process driving 4 GPUs (4 engines), where a collective overlaps GEMMs; the
    # NumPy devices' own engines (4 on one host) would queue it behind them
    monkeypatch.setattr(rates, "engines", lambda mesh: (4, 1))
    comm_bound = gpu_like(comm_bw={op: 1e8 for op in cost.BUS_FACTOR})  # the Allgather ~ as long as the GEMM
    f = seed(mesh, "auto", rates=comm_bound)
    rng = np.random.default_rng(15)
    a, b = rng.standard_normal((64, 16)), rng.standard_normal((16, 8))
    plan = f.lower(sf.shard(a, 0, mesh=mesh), b)
    s = plan.explain().chosen
    assert s > 1 and plan.collectives() == {"allgather": s}
    assert f"S={s}: hides" in plan.explain().reason
    got = f(sf.shard(a, 0, mesh=mesh), b).gather()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-12, atol=1e-12)


def test_explain_lists_every_candidate_and_why():
    mesh = sf.DeviceMesh(4, backend="numpy")
    why = seed(mesh, "auto", rates="h200").lower(*specs(48, 16, 8)).explain()
    assert [c.s for c in why.candidates] == [1, 2, 3, 4, 6, 8, 12, 16]  # the divisors of 48 up to 16
    refused = {c.s for c in why.candidates if c.error}
    assert refused == {8, 16}  # 48 rows cannot be cut into 4 devices x 8 chunks
    text = str(why)
    for c in why.candidates:
        assert f" {c.s} " in text
    assert "not possible" in text and why.reason in text and f"chose S={why.chosen}" in text
    fixed = seed(mesh, 4, rates="h200").lower(*specs(48, 16, 8)).explain()
    assert [c.s for c in fixed.candidates] == [4] and "chunks fixed (S=4)" in str(fixed)


def test_auto_traces_the_function_once_per_signature():
    """chunks="auto": the traced program keeps "auto" and is compiled once per candidate S; the
    user's function runs once per input signature (issue 30, item 2)."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    calls = []

    def ag_gemm(a, b):
        calls.append(a.shape)
        return sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks="auto")
    f = sf.jit(ag_gemm, mesh=mesh, streams=2, rates="h200")
    why = f.lower(*specs(48, 16, 8)).explain()
    assert len(why.candidates) == 8 and calls == [(48, 16)]
    f.lower(*specs(48, 16, 8))
    f.lower(*specs(64, 16, 8))
    assert calls == [(48, 16), (64, 16)]
    from shardfuse.trace import trace

    assert "chunks=auto" in str(trace(ag_gemm, mesh, specs(48, 16, 8), 2))  # (the traced program, as stated)


def test_a_plan_without_auto_never_asks_the_cost_model(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the cost model was consulted for a plan without chunks='auto'")
    import sys

    monkeypatch.setattr(sys.modules["shardfuse.jit"], "machine", refuse)  # (sf.jit, the function, shadows the module)
    mesh = sf.DeviceMesh(4, backend="numpy")
    assert seed(mesh, 4).lower(*specs(48, 16, 8)).collectives() == {"allgather": 4}
    with pytest.raises(AssertionError, match="the cost model was consulted"):  # (the patch holds: "auto" asks)
        seed(mesh, "auto").lower(*specs(48, 16, 8))


def test_auto_in_the_mlp_computes_right():
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference

    mesh = sf.DeviceMesh(2, backend="numpy")
    args = mlp_inputs(np.random.default_rng(1), 8, 4)
    f = mlp_block(mesh, "sp", chunks="auto")
    np.testing.assert_allclose(f(*args).gather(), mlp_reference(*args), rtol=1e-10, atol=1e-10)
    assert f.lower(*args).explain().auto


def test_auto_refused_where_it_means_nothing():
    mesh = sf.DeviceMesh(2, backend="numpy")
    with pytest.raises(ValueError, match="chunks='auto' chooses S for algorithm='collective'"):
        seed(mesh, "auto", algorithm="ring").lower(*specs(8, 4, 2))
    with pytest.raises(TypeError, match="chunks= must be an int or \"auto\", got 'fast'"):
        seed(mesh, "fast").lower(*specs(8, 4, 2))
    with pytest.raises(TypeError, match="rates= must be"):
        sf.jit(lambda a: a, mesh=mesh, rates=3)


# ---- calibration and its cache -------------------------------------------------------------------
def test_calibrate_writes_a_readable_cache_that_auto_uses(cache_dir, capsys):
    assert cli(["calibrate", "--backend", "numpy", "--devices", "2", "--repeat", "2"]) == 0
    mesh = sf.DeviceMesh(2, backend="numpy")
    key = rates.machine_key(mesh)
    doc = json.loads(rates.cache_path(key).read_text())
    assert doc["key"] == key and rates.cache_path(key).parent == cache_dir
    r = cost.Rates.from_json(doc["rates"])
    assert r.serial and r.gemm_flops["float64"] > 0 and r.comm_bw[Op.ALLGATHER] > 0
    assert "wrote" in capsys.readouterr().out
    assert seed(mesh, "auto").lower(*specs(8, 4, 2)).explain().rates_name == "calibrated numpy x2"
    assert cli(["calibrate", "--backend", "numpy", "--devices", "2"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_cache_is_rebuilt_when_its_key_changes(monkeypatch):
    mesh = sf.DeviceMesh(2, backend="numpy")
    calls = []
    monkeypatch.setattr(calibrate, "calibrate", lambda mesh, repeat, log: calls.append(1) or replace(cost.CPU, name="m"))
    assert calibrate.ensure(mesh)[2] and calibrate.ensure(mesh)[2] is False and len(calls) == 1
    assert rates.machine(mesh)[0].name == "m"
    key = rates.machine_key(mesh)
    monkeypatch.setattr(rates, "machine_key", lambda mesh: {**key, "numpy": "99.0"})  # a library update
    assert rates.machine(mesh)[0] is cost.CPU  # stale: the defaults until calibrated again
    r, path, measured = calibrate.ensure(mesh)
    assert measured and len(calls) == 2 and json.loads(path.read_text())["key"]["numpy"] == "99.0"


BAD_RATES = {"NEGATIVE": {"step_s": -1.0}, "GEMM_LIST": {"gemm_flops": []}, "BW_NULL": {"comm_bw": None},
             "SERIAL_STR": {"serial": "false"}, "NAME_NUM": {"name": 3}}


@pytest.mark.parametrize("content", ["{not json", '{"key": 1}', "[]", "KEY", *BAD_RATES])
def test_a_corrupt_cache_warns_and_falls_back(content):
    mesh = sf.DeviceMesh(2, backend="numpy")
    key = rates.machine_key(mesh)
    path = rates.cache_path(key)
    path.parent.mkdir(parents=True)
    text = json.dumps({"key": key, "rates": {**cost.CPU.to_json(), **BAD_RATES[content]}}) if content in BAD_RATES \
        else json.dumps({"key": key}) if content == "KEY" else content
    path.write_text(text)
    with pytest.warns(UserWarning, match="corrupt rates cache"):
        assert rates.machine(mesh)[0] is cost.CPU
    with pytest.warns(UserWarning):
        assert seed(mesh, "auto").lower(*specs(8, 4, 2)).explain().chosen == 1  # compiles all the same


def test_rates_survive_json():
    for r in cost.DEFAULTS.values():
        assert cost.Rates.from_json(json.loads(json.dumps(r.to_json()))) == r


# ---- the simulator and the sweep ------------------------------------------------------------------
def test_simulate_prints_the_prediction_and_draws_it(tmp_path, capsys):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert cli(["simulate", "--devices", "8", "--gpu", "h200", "--m", "32768", "--k", "32768", "--n", "8192",
                "--dtype", "bf16", "--chunks", "auto", "--png", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "chose S=" in out and "predicted total" in out and "overlap efficiency" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(trace.read_text())
    assert {e["cat"] for e in doc["traceEvents"] if e["ph"] == "X"} >= {"gemm", "communication"}
    assert cli(["simulate", "--mlp", "--devices", "4", "--m", "4096", "--k", "1024", "--chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "MLP block (sp)" in out and "'reduce_scatter': 2" in out


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--m", "0"], "--m must be an int >= 1, got 0"),
    (["simulate", "--chunks", "many"], "--chunks must be a positive int or auto, got 'many'"),
    (["simulate", "--devices", "3", "--m", "8"], "does not"),
    (["calibrate", "--backend", "numpy", "--repeat", "0"], "--repeat must be an int >= 1, got 0"),
])
def test_cli_mistakes_are_one_line(argv, message, capsys):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_sweep_runs_on_numpy_devices(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert cli(["bench", "--sweep", "--backend", "numpy", "--devices", "2", "--repeat", "2", "--sweep-m", "16,32",
                 "--sweep-nk", "8x8", "--sweep-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model (numpy/cpu rates) within 15%" in text and "chunks='auto' vs the best fixed S" in text
    points = json.loads(out.read_text())["points"]
    assert [p["m"] for p in points] == [16, 32] and all(p["auto"] == 1 for p in points)
    assert all(len(r["passes_ms"]) == 2 and r["measured_ms"] == min(r["passes_ms"]) for p in points
               for r in p["rows"].values())
    assert _script("auto_spread").main([str(out)]) == 0
    assert "within a run, between an S's two passes: median" in capsys.readouterr().out


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RECORDED = sorted((BENCHMARKS / "results").glob("2026-12-05-h200-sweeps*/sweep_d*.json"))


def _script(name):
    """benchmarks/NAME.py as a module (benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recorded_sweeps_are_there():
    assert len(RECORDED) == 7, RECORDED  # else the pin below would run on none of them


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_model_predicts_the_recorded_h200_sweeps_as_recorded(path):
    """A pin between cost.py and measured H200 data: each sweep recorded on 2026-12-05 (model 4)
    predicted again from its own rates, on a CPU, gives the times the H200 run predicted.  A change
    to what cost.py predicts fails here: bump rates.MODEL (so cached rates are recalibrated) and
    take the pin to newly recorded sweeps."""
    assert rates.MODEL == 4, "the recorded sweeps are of cost model 4: record sweeps of the new model"
    refit = _script("refit_sweeps")
    recorded_rates, points, d = refit.load(path)
    table = refit.rows(points, d)
    got = refit.score(recorded_rates, table, d)["pred"]
    want = [r[4] for r in table]
    assert len(table) == 60
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_runs_of_other_process_counts_keep_their_own_cache_files():
    key = rates.machine_key(sf.DeviceMesh(4, backend="numpy"))
    assert rates.cache_path(key) != rates.cache_path({**key, "processes": 2})  # mpiexec -n 2 on the same 4 devices


def test_with_one_stream_auto_says_nothing_can_overlap(capsys):
    assert cli(["simulate", "--devices", "8", "--gpu", "h200", "--streams", "1", "--chunks", "auto"]) == 0
    assert "S=1: with streams=1 every chunk's steps run on one stream" in capsys.readouterr().out


def test_calibration_runs_on_a_mesh_its_sizes_were_not_chosen_for():
    # 3 devices do not divide the host test's 64 elements nor the collectives' 2**k: each is rounded
    lines = []
    rates = calibrate.calibrate(sf.DeviceMesh(3, backend="numpy"), repeat=1, log=lines.append)
    assert rates.name == "calibrated numpy x3" and any(line.startswith("  collectives:") for line in lines), lines


def test_a_prediction_prints_in_one_line():
    pred = seed(sf.DeviceMesh(8, backend="numpy"), 64, rates="h200").lower(*specs(4096, 64, 64)).predict()
    assert repr(pred) == f"Prediction('ag_gemm': {pred.total_s * 1e3:.3f} ms, {len(pred.events)} steps)"


def test_a_gemms_fixed_time_is_the_same_in_every_dtype():
    # the half-rate size is the fastest dtype's: at float32's peak the same FLOPs were a 37 us floor
    tiny = 2 * 256 ** 3
    f32, bf16 = (cost.gemm_time(tiny, 0, dt, cost.H200) for dt in ("float32", "bfloat16"))
    fixed = cost.H200.gemm_half_flops / max(cost.H200.gemm_flops.values())
    assert f32 == pytest.approx(tiny / cost.H200.gemm_flops["float32"] + fixed) and f32 < 10e-6
    assert bf16 == pytest.approx(tiny / cost.H200.gemm_flops["bfloat16"] + fixed)


def test_explain_names_every_loop_and_why_no_other_s_was_possible():
    mesh, f32 = sf.DeviceMesh(2, backend="numpy"), lambda *s: sf.TensorSpec(s, "float32")
    two = sf.jit(lambda a, b: sf.stream(sf.stream(sf.shard(a, 0) @ b, axis=0, chunks=4) @ b.T, axis=0, chunks=2),
                 mesh=mesh, rates="h200").lower(f32(16, 8), f32(8, 8)).explain()
    assert "chunks fixed (S=2, 4)" in str(two) and two.reason.startswith("S=2, 4: ")
    none = sf.jit(lambda a, b: a @ b, mesh=mesh, rates="h200").lower(f32(16, 8), f32(8, 8)).explain()
    assert "chunks fixed (no stream loop)" in str(none) and "S=1" not in str(none)
    only = seed(sf.DeviceMesh(4, backend="numpy"), "auto", rates="h200").lower(*specs(68, 8, 8)).explain()
    assert only.chosen == 1 and "no other S up to 16 divides the streamed extents" in only.reason


def test_auto_keeps_the_fewest_chunks_within_the_margin_of_the_fastest():
    # comparing each S with the best so far, S = 4 beat S = 1 by over 1% (1.25%) and won, though
    # S = 2 is within 1% of it; the rule keeps the fewest chunks within the margin of the fastest
    from shardfuse.autochunks import Candidate, choose

    ok = [Candidate(1, 1.0), Candidate(2, 0.991), Candidate(4, 0.9875), Candidate(8, 0.9990)]
    assert choose(ok).s == 2
    assert choose([Candidate(1, 1.0), Candidate(2, 0.995)]).s == 1
    assert choose([Candidate(1, 1.0), Candidate(2, 0.98)]).s == 2
    assert choose([Candidate(1, 1.0), Candidate(2, 0.98)], margin=0.03).s == 1


def test_no_margin_would_have_changed_auto_in_the_recorded_sweeps(capsys):
    """Issue 29, item 3 (benchmarks/auto_spread.py): in every recorded H200 sweep the model put
    S = 1 strictly fastest, so the margin never decided a choice: any margin from 0 to 15% picks
    the recorded S at every point; picking more chunks where the predictions are level misses."""
    spread = _script("auto_spread")
    shapes = spread.load(RECORDED)
    points = [p for runs in shapes.values() for p in runs.values()]
    assert len(points) == 7 * 12 and {p["auto"] for p in points} == {1}
    for margin in (0.0, 0.01, 0.03, 0.05, 0.15):
        assert all(spread.margin_rule(margin)(p) == p["auto"] for p in points), margin
    assert max(spread.miss(p, p["auto"]) for p in points if p["devices"] == 2) < 0.03
    assert spread.main([str(path) for path in RECORDED]) == 0
    assert "not recorded" in capsys.readouterr().out  # these sweeps kept one time of the two passes
