"""plan.profile and its Timeline on NumPy devices (host clocks): one interval per executed step,
the Chrome trace, the Gantt chart and the summary figures (issue 15, item 1)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import shardfuse as sf
from shardfuse.timeline import KINDS


def seed(d=4, s=4):
    mesh = sf.DeviceMesh(d, backend="numpy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh, streams=2)
    rng = np.random.default_rng()
    a, b = rng.standard_normal((s, d, 8, 16)), rng.standard_normal((16, 8))
    return f.lower(a, b), a, b


@pytest.mark.parametrize("d, repeat", [(1, 1), (4, 3)])
def test_one_interval_per_executed_step_with_its_plan_line(d, repeat):
    plan, a, b = seed(d)
    tl = plan.profile(a, b, repeat=repeat)
    exe = plan.executable
    assert len(tl) == repeat * len(exe.steps)
    assert sorted((e.call, e.step) for e in tl.events) == [(c, s.index) for c in range(repeat) for s in exe.steps]
    lines = {line.strip() for line in str(plan).splitlines()}
    for e in tl.events:
        assert e.text.split("  [")[0] in lines, e.text  # the instruction as print(plan) shows it
        assert e.end >= e.start >= 0 and e.devices == tuple(range(d)) and e.kind in KINDS
    kinds = {e.kind for e in tl.events}
    assert "gemm" in kinds and (("communication" in kinds) == (d > 1))  # at D = 1 the gathers fold
    # steps run one after another on the host: no two intervals overlap
    spans = sorted((e.start, e.end) for e in tl.events)
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    np.testing.assert_allclose(plan(a, b).gather(), np.einsum("sdmk,kn->sdmn", a, b), rtol=1e-12, atol=1e-12)  # still right


def test_summary_figures_add_up():
    plan, a, b = seed()
    s = plan.profile(a, b, repeat=2).summary()
    assert s["steps"] > 0 and s["total_s"] > 0
    busy = s["communication_s"] + s["gemm_s"] + s["compute_s"] + s["copy_s"]
    assert busy <= s["total_s"] * 1.000001  # serial: kinds never overlap in time
    assert s["exposed_communication_s"] == pytest.approx(s["communication_s"])  # nothing hides it on the host
    assert s["overlap_efficiency"] == pytest.approx(max(s["communication_s"], s["gemm_s"] + s["compute_s"]) / s["total_s"])


def test_concurrent_communication_is_exposed_once():
    """Two collectives at the same time (two streams, or two ranks) hide behind the same GEMM or
    not at all: exposed communication is of their union, never more than the communication."""
    from shardfuse.timeline import Event, Timeline

    def ev(stream, kind, start, end):
        return Event(0, 0, stream, (0,), str(stream), kind, kind, start, end)

    s = Timeline([ev(0, "communication", 0.0, 1.0), ev(1, "communication", 0.0, 1.0)]).summary()
    assert s["communication_s"] == s["exposed_communication_s"] == pytest.approx(1.0)
    s = Timeline([ev(0, "communication", 0.0, 1.0), ev(1, "communication", 0.5, 2.0), ev(2, "gemm", 0.75, 1.5)]).summary()
    assert s["communication_s"] == pytest.approx(2.0) and s["exposed_communication_s"] == pytest.approx(1.25)


def test_each_profiled_call_has_its_own_figures():
    plan, a, b = seed()
    tl = plan.profile(a, b, repeat=3)
    calls = [tl.summary(call=k) for k in range(3)]
    assert all(c["steps"] == len(plan.executable.steps) for c in calls)  # (one interval per step and call)
    assert sum(c["total_s"] for c in calls) <= tl.summary()["total_s"]  # calls run one after another
    with pytest.raises(ValueError, match="recorded calls 0..2"):  # (was an all-zero report: a probe)
        tl.summary(call=3)


def test_communication_hides_only_behind_its_own_devices_compute():
    """Another device's (or rank's, whose clock is its own) GEMM hides nothing: the summary is the
    slowest device's, computed on its own events."""
    from shardfuse.timeline import Event, Timeline

    def ev(rank, device, kind, start, end):
        return Event(rank, 0, 0, (device,), "0", kind, kind, start, end)

    for a, b in (((0, 0), (0, 1)), ((0, 0), (1, 0))):  # two devices of a process; two ranks
        s = Timeline([ev(*a, "communication", 0.0, 1.0), ev(*b, "gemm", 0.0, 1.0), ev(*b, "gemm", 1.0, 1.5)]).summary()
        assert s["exposed_communication_s"] == pytest.approx(0.0) and s["device"] == b  # b's is the longer
        s = Timeline([ev(*a, "communication", 0.0, 2.0), ev(*b, "gemm", 0.0, 1.0)]).summary()
        assert s["device"] == a and s["exposed_communication_s"] == pytest.approx(2.0)
        assert s["overlap_efficiency"] == pytest.approx(1.0) and s["gemm_s"] == 0.0


@pytest.mark.parametrize("repeat", [0, -1, 1.5, True])
def test_profile_repeat_must_be_a_positive_int(repeat):
    plan, a, b = seed()
    with pytest.raises((TypeError, ValueError), match="repeat"):
        plan.profile(a, b, repeat=repeat)


def test_chrome_trace_is_json_with_a_track_per_device_and_stream(tmp_path):
    plan, a, b = seed(d=4)
    tl = plan.profile(a, b)
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    doc = json.load(open(path))
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == {f"rank 0 device {d}" for d in range(4)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert len(events) == 4 * len(tl)  # each step on each of its devices' tracks
    assert all(isinstance(e["tid"], int) for e in events)  # named by thread_name metadata, as Perfetto wants
    assert {threads[e["pid"], e["tid"]] for e in events} == {f"stream {e.stream}" for e in tl.events}
    assert len(threads) == 4 * len({e.stream for e in tl.events})  # a track per device and stream
    assert all(e["dur"] >= 0 and e["cat"] in KINDS for e in events)


def test_plot_renders_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra")
    plan, a, b = seed(d=2)
    path = tmp_path / "timeline.png"
    fig = plan.profile(a, b).plot(path=path)
    assert fig.axes and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_of_a_plan_without_loops():
    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda a: sf.shard(a, axis=0) * 2.0, mesh=mesh, graph=False)
    x = np.ones((4, 2))
    assert len(f.lower(x).profile(x)) == len(f.lower(x).executable.steps)


def test_cli_writes_the_trace_and_the_chart(tmp_path):
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    r = subprocess.run([sys.executable, "-m", "shardfuse", "profile", "--devices", "2", "--m", "8", "--k", "16",
                        "--n", "8", "--trace", str(trace), "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "overlap efficiency" in r.stdout and json.load(open(trace))["traceEvents"]
    assert png.read_bytes()[:4] == b"\x89PNG"


# ---- NVTX ranges (plan.profile(nvtx=True), shardfuse profile --nvtx) ----------------------------
def _recording_nvtx(monkeypatch):
    """A stand-in nvtx module that records every push and pop, in order (no CUDA needed)."""
    import types

    log = []
    fake = types.SimpleNamespace(push_range=lambda message=None, **kw: log.append(("push", message)),
                                 pop_range=lambda **kw: log.append(("pop", None)))
    monkeypatch.setitem(sys.modules, "nvtx", fake)
    return log


def _facts(tl):  # an event without its times, which differ from run to run
    return [(e.call, e.step, e.devices, e.stream, e.text, e.kind) for e in tl.events]


def test_nvtx_profile_gives_the_same_events():
    import nvtx  # noqa: F401  (the [nvtx] extra, in [test]: a no-op without CUDA or nsys)

    plan, a, b = seed(d=2)
    plain, ranged = plan.profile(a, b, repeat=2), plan.profile(a, b, repeat=2, nvtx=True)
    assert len(ranged) == 2 * len(plan.executable.steps)
    assert sorted(_facts(ranged), key=lambda f: f[:2]) == sorted(_facts(plain), key=lambda f: f[:2])


@pytest.mark.parametrize("repeat", [1, 3])
def test_nvtx_ranges_are_the_plan_and_its_step_labels(monkeypatch, repeat):
    log = _recording_nvtx(monkeypatch)
    plan, a, b = seed(d=4)
    tl = plan.profile(a, b, repeat=repeat, nvtx=True)
    labels = [s.text for s in plan.executable.steps]
    one_call = [("push", plan.program.name)] + [x for t in labels for x in (("push", t), ("pop", None))] + [("pop", None)]
    assert log == one_call * repeat  # nested and balanced: each step inside its call's range
    assert {e.text for e in tl.events} == set(labels)  # the names the Timeline (and print(plan)) shows
    log.clear()
    plan.profile(a, b)  # off by default: no range at all
    assert log == []


def test_nvtx_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # `import nvtx` raises ImportError
    plan, a, b = seed(d=2)
    with pytest.raises(ImportError, match=r"pip install \"shardfuse\[nvtx\]\" \(or pip install nvtx\)"):
        plan.profile(a, b, nvtx=True)
    assert len(plan.profile(a, b)) == len(plan.executable.steps)  # without nvtx=True nothing needs it


def test_cli_nvtx_missing_is_refused_before_any_work(monkeypatch, capsys):
    from shardfuse.cli import main

    monkeypatch.setitem(sys.modules, "nvtx", None)
    with pytest.raises(SystemExit) as e:
        main(["profile", "--nvtx", "--devices", "2", "--m", "16", "--k", "8", "--n", "8"])
    assert e.value.code == 2 and "--nvtx needs the nvtx package" in capsys.readouterr().err


def test_cli_nvtx_pushes_the_ranges(tmp_path, monkeypatch, capsys):
    from shardfuse.cli import main

    log = _recording_nvtx(monkeypatch)
    trace = tmp_path / "t.json"
    argv = ["profile", "--nvtx", "--devices", "2", "--m", "16", "--k", "8", "--n", "8", "--repeat", "2", "--trace", str(trace)]
    assert main(argv) == 0
    names = {e["name"] for e in json.load(open(trace))["traceEvents"] if e["ph"] == "X"}  # the step labels
    inner = [m for kind, m in log[1:-1] if kind == "push" and m != "ag_matmul"]
    one_call = [("push", "ag_matmul")] + [x for t in inner[:len(inner) // 2] for x in (("push", t), ("pop", None))] + [("pop", None)]
    assert log == one_call * 2 and set(inner) == names, log
    assert "--backend cupy profiles GPUs" in capsys.readouterr().out


def test_cli_dtype_must_suit_the_backend(tmp_path, capsys):
    from shardfuse.profile_cli import main

    with pytest.raises(SystemExit) as e:
        main(["--dtype", "float16", "--trace", str(tmp_path / "t.json")])  # a GPU dtype, on the default numpy backend
    assert e.value.code == 2 and "--dtype float16 is not profiled on numpy" in capsys.readouterr().err


def test_a_summary_of_a_call_not_recorded_is_refused():
    """A probe: summary(call=5) of a timeline of two calls was all zeros with overlap efficiency 1.0."""
    plan, a, b = seed()
    tl = plan.profile(a, b, repeat=2)
    assert tl.summary(call=1)["steps"] > 0
    with pytest.raises(ValueError, match=r"summary\(call=5\): this timeline recorded calls 0..1"):
        tl.summary(call=5)


def test_copies_are_device_work_communication_hides_behind():
    """A plan of copies alone reported overlap efficiency 0.0, and communication beside a copy as
    exposed (a probe): a copy is device work as a GEMM is."""
    from shardfuse.timeline import Event, Timeline

    def ev(kind, start, end, stream=0):
        return Event(0, 0, stream, (0,), str(stream), kind, kind, start, end)

    alone = Timeline([ev("copies", 0.0, 1.0), ev("copies", 1.0, 2.0)]).summary()
    assert alone["overlap_efficiency"] == 1.0 and alone["copy_s"] == 2.0
    beside = Timeline([ev("copies", 0.0, 2.0), ev("communication", 0.5, 2.5, 1)]).summary()
    assert beside["exposed_communication_s"] == 0.5 and beside["overlap_efficiency"] == 2.0 / 2.5
