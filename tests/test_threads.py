"""One jitted function called from several Python threads at once gives every thread its own
correct results (the executor issues one call at a time per plan)."""
import sys
import threading

import numpy as np

import shardfuse as sf


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

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so unguarded calls would interleave
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors and wrong == [0, 0, 0, 0]
