"""Gradient bucketing under mpiexec (tests/test_bucket.py's checks on the NumPy-over-MPI backend):
the data-parallel layer's gradients in one bucketed Allreduce, bit for bit those of one Allreduce
per parameter, and right against float64 central differences; the 2x2 dp x tp mesh's chained
buckets (under -n 2 each process' two devices lie in two dp teams: one bucketed Allreduce per team);
the bucket's plan, its Allreduce on a stream of its own, the same on every rank; a lone Allreduce on
that stream too, waited for where it is read."""
from __future__ import annotations

import test_bucket as tb
from test_nn import mesh_of


def test_data_parallel_layer_gradients_in_one_bucket(monkeypatch):
    tb.check_dp_layer(tb.dp_mesh(), tb.DP, monkeypatch, before=13, after=1)


def test_dp_x_sp_layer_gradients_in_chained_buckets(monkeypatch):
    tb.check_dp_layer(mesh_of("2d"), tb.DP_SP, monkeypatch, before=19, after=3)


def test_independent_sums_share_one_allreduce(monkeypatch):
    tb.test_independent_sums_share_one_allreduce_dependent_ones_do_not(monkeypatch)


def test_the_plan_of_a_bucket_on_its_stream(monkeypatch):
    """Every rank's plan: the bucket's Allreduce on its own stream (a no-op switch on NumPy devices,
    where the Iallreduce runs while the host issues the steps after it)."""
    tb.test_the_plan_of_a_bucket_on_its_stream(monkeypatch)


def test_a_lone_gradient_allreduce_runs_beside_the_rest_of_the_backward(monkeypatch):
    """Its Iallreduce issued on the side stream (a no-op switch here) and waited for where the update
    reads it: the same numbers as waited for at once, and right against central differences."""
    tb.test_a_lone_gradient_allreduce_runs_beside_the_rest_of_the_backward(monkeypatch)


def test_the_plan_of_a_lone_allreduce_on_the_side_stream(monkeypatch):
    tb.test_the_plan_of_a_lone_allreduce_on_the_side_stream(monkeypatch)


def test_size_cap_splits_buckets_lone_ones_on_the_side_stream(monkeypatch):
    tb.test_size_cap_splits_buckets(monkeypatch)
