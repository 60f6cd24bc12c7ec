"""One jitted function called from several Python threads at once gives every thread its own
correct results (the executor issues one call at a time per plan)."""
import sys
import threading

import numpy as np

import shardfuse as sf


def run_in_threads(work, n):
    """work(t) for t < n, each in its own thread, switching threads often (so unguarded shared
    state would interleave)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)


def test_one_jitted_function_from_four_threads():
    mesh = sf.DeviceMesh(4, backend="numpy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=0) @ b, axis=0, chunks=4), mesh=mesh, streams=2)
    wrong, errors = [0] * 4, []

    def work(t):
        rng = np.random.default_rng(t)
        try:
            for _ in range(100):
                a, b = rng.standard_normal((32, 8)), rng.standard_normal((8, 4))
                if not np.allclose(f(a, b).gather(), a @ b, rtol=1e-12, atol=1e-12):
                    wrong[t] += 1
        except Exception as e:  # an exception in a thread would otherwise pass unseen
            errors.append(e)

    run_in_threads(work, 4)
    assert not errors and wrong == [0, 0, 0, 0]


def test_threads_calling_while_plans_are_evicted_keep_the_cache_consistent():
    """max_plans=1 and four threads with four shapes: every call compiles or evicts; no thread may
    leave the dispatch table naming a dropped plan (that made every later call of its shape raise)."""
    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda a, b: sf.shard(a, axis=0) @ b, mesh=mesh, max_plans=1)
    wrong, errors = [0] * 4, []

    def work(t):
        rng = np.random.default_rng(t)
        try:
            for _ in range(200):
                a, b = rng.standard_normal((4 * (t + 1), 8)), rng.standard_normal((8, 3))
                if not np.allclose(f(a, b).gather(), a @ b, rtol=1e-12, atol=1e-12):
                    wrong[t] += 1
        except Exception as e:
            errors.append(e)

    run_in_threads(work, 4)
    assert not errors and wrong == [0, 0, 0, 0], errors[:1]
    info = f.cache_info()
    assert info["plans"] == 1 and info["dispatch"] <= 1  # every dispatch entry names the kept plan
    for rows in (4, 8, 12, 16):  # and every shape still runs afterwards
        a = np.ones((rows, 8))
        np.testing.assert_allclose(f(a, np.ones((8, 3))).gather(), a @ np.ones((8, 3)))
