"""`shardfuse demo --layer tp|sp|dp` and `shardfuse demo --train`, run in-process on fresh random
inputs (each prints its seed): the layer against its float64 NumPy reference with its collectives
per call, the GPT's float64 gradients against central differences and the Adam steps' losses;
a failing check exits 1; bad flags are one line and exit 2.  tests/test_mpi.py runs --train
under mpiexec -n 2."""
from __future__ import annotations

import re

import pytest

from shardfuse import demo_model
from shardfuse.cli import main

SMALL = ["--backend", "numpy", "--hidden", "16", "--heads", "4", "--chunks", "2"]


@pytest.mark.parametrize("mode, devices, mesh, collectives", [
    ("tp", 4, "DeviceMesh(tp=4", {"allreduce": 4}),  # two row-parallel GEMMs, each pipelined over 2 chunks
    ("sp", 4, "DeviceMesh(tp=4", {"allgather": 4, "reduce_scatter": 4}),
    ("dp", 4, "DeviceMesh(dp=2, tp=2", {"allgather": 4, "reduce_scatter": 4}),
])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_demo_layer_checks_against_the_float64_reference(mode, devices, mesh, collectives, dtype, capsys):
    assert main(["demo", "--layer", mode, "--devices", str(devices), "--m", "32", "--dtype", dtype, *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.count(mesh) == 1 and f"transformer layer ({mode}" in out and "4 heads" in out
    assert "x[2, 16, 16]" in out  # --m is the tokens: batch 2 x seq 16
    assert re.search(r"float64 NumPy layer: relative error \S+ \(tolerance \S+\) -> OK", out), out
    assert f"collectives per call: {collectives}" in out
    assert "plan <lambda>(" in out and "FAILED" not in out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_train_checks_gradients_and_the_loss_falls(dtype, capsys):
    """The gradient check is in float64 whatever --dtype; the steps train in --dtype."""
    assert main(["demo", "--train", "--devices", "2", "--steps", "4", "--lr", "0.02", "--dtype", dtype, *SMALL]) == 0
    out = capsys.readouterr().out
    assert "a 2-layer GPT (vocab 16, hidden 16, 4 heads, seq 16, batch 2), tp=tp, sp=True, chunks=2" in out
    assert re.search(r"central difference \S+ -> OK", out), out
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    assert re.search(r"in 4 Adam steps -> OK", out) and "FAILED" not in out


def test_demo_train_exits_1_when_the_gradient_check_fails(monkeypatch, capsys):
    """A reference that differs from the model's loss (by a smooth term) fails the check."""
    ref = demo_model.gpt_reference
    monkeypatch.setattr(demo_model, "gpt_reference", lambda p, i, l, h: ref(p, i, l, h) + 1e-3 * float((p["head"] ** 2).sum()))
    assert main(["demo", "--train", "--devices", "2", "--steps", "2", *SMALL]) == 1
    assert "-> FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--layer", "tp", "--mlp", "sp"], "--mlp, --layer and --train each choose a demo: give one of them"),
    (["--train", "--layer", "sp"], "--mlp, --layer and --train each choose a demo: give one of them"),
    (["--layer", "xp"], "argument --layer: invalid choice: 'xp'"),
    (["--train", "--json"], "--json is for the seed and --mlp demos"),
    (["--train", "--lr", "0"], "--lr must be a positive float, got 0.0"),
    (["--train", "--m", "32"], "--train sizes its token task itself"),
    (["--train", "--dtype", "float16"], "--train trains in float32, bfloat16 or float64"),
    (["--train", "--steps", "0"], "--steps must be a positive int, got 0"),
    (["--layer", "sp", "--heads", "0"], "--heads must be a positive int, got 0"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--layer", "dp", "--devices", "3"], "--layer dp needs an even number of devices (a 2 x 3/2 dp x tp mesh), got 3"),
    (["--layer", "sp", "--devices", "2", "--m", "20"], "--m is the layer's tokens, batch x seq with batch 2: 20 must "
     "be a multiple of 2 x --chunks x tp devices = 2 x 2 x 2 = 8"),
    (["--layer", "tp", "--devices", "4", "--heads", "2"], "--heads 2 must divide --hidden 16 and be a multiple of "
     "the 4 tensor-parallel devices"),
    (["--train", "--devices", "2", "--heads", "5"], "--heads 5 must divide --hidden 16"),
])
def test_sizes_that_do_not_divide_are_one_line_and_exit_2(argv, message, capsys):
    small = SMALL[:SMALL.index("--heads")] + SMALL[SMALL.index("--chunks"):]  # without --heads
    heads = [] if "--heads" in argv else ["--heads", "4"]
    assert main(["demo", *argv, *small, *heads]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
