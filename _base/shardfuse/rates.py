"""Which rates the cost model uses on a mesh: calibrated ones from the cache, else built-in defaults.

`shardfuse calibrate` (shardfuse/calibrate.py) measures a machine's rates and caches them as JSON,
one file per backend and mesh size, under $SHARDFUSE_CACHE_DIR, else $XDG_CACHE_HOME/shardfuse,
else ~/.cache/shardfuse.  A file records the key it was measured under (backend, GPU model,
driver, CUDA runtime, NCCL and CuPy versions, devices, processes, the model's version): one whose key differs from
this machine's is stale (calibrate rebuilds it; until then the defaults hold), and a corrupt one
is ignored with a warning, never an error.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

from shardfuse.cost import CPU, DEFAULTS, H200, Rates
from shardfuse.runtime import backend_of

log = logging.getLogger("shardfuse")
KEY_FIELDS = ("backend", "gpu", "driver", "cuda_runtime", "nccl", "cupy", "numpy")
# The cost model's version: rates measured for an older one are stale (before 3: max roofline, no
# shared-GPU rule; before 4: on a shared GPU, gemm_bw from chains, not from its pipelined GEMMs).
MODEL = 4


def cache_dir() -> Path:
    if os.environ.get("SHARDFUSE_CACHE_DIR"):
        return Path(os.environ["SHARDFUSE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardfuse"


def machine_key(mesh) -> dict:
    """What calibrated rates hold for: the backend's libraries and GPU, and the mesh's size."""
    be = backend_of(mesh)
    desc = be.describe()
    key = {k: desc[k] for k in KEY_FIELDS if k in desc}
    gpus = len(set(be.ordinals)) if be.ordinals else 0
    return {**key, "devices": mesh.size, "processes": mesh.nprocs, "gpus": gpus, "model": MODEL}


def cache_path(key: dict) -> Path:
    """One file per backend, mesh size and process count (all in the key: runs that differ in
    them must not overwrite each other's rates)."""
    return cache_dir() / f"rates-{key['backend']}-{key['devices']}dev-{key['processes']}proc.json"


def load(key: dict) -> Rates | None:
    """The cached rates for key, or None (no file, a stale one, or a corrupt one: warned)."""
    path = cache_path(key)
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("key"), dict):
            raise ValueError("no key")
        if doc["key"] != key:
            log.info("rates cache %s is stale (measured for %s, this machine is %s): run `shardfuse calibrate`",
                     path, doc["key"], key)
            return None
        return Rates.from_json(doc["rates"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring the corrupt rates cache {path} ({type(e).__name__}: {e}); using the built-in "
                      "defaults (run `shardfuse calibrate` to rebuild it)", stacklevel=2)
        return None


def save(key: dict, rates: Rates) -> Path:
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "rates": rates.to_json()}, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    return path


def defaults_for(key: dict) -> Rates:
    """The built-in entry for this machine: NumPy devices, or the H200's figures on any GPU."""
    if str(key["backend"]).startswith("numpy"):  # numpy, numpy-mpi
        return CPU
    gpu = str(key.get("gpu", ""))
    if "H200" not in gpu and "H100" not in gpu:
        log.info("no built-in rates for %r: using the H200's (run `shardfuse calibrate`)", gpu)
    return H200


def engines(mesh) -> tuple:
    """(local, share): devices this process issues each step for, and devices whose compute runs
    one after another on one engine (NumPy devices all; virtual devices of one GPU)."""
    be = backend_of(mesh)
    local = len(be.local_devices)
    return local, (local if not be.ordinals else max(1, local // len(set(be.ordinals))))


def machine(mesh, rates: Rates | str | None = None) -> tuple:
    """(rates, local, share) for predicting plans on mesh: rates given (a Rates, or a name of
    cost.DEFAULTS), else calibrated ones from the cache, else the defaults.  A GPU's rates on a
    mesh of NumPy devices predict one GPU per device, each in its own process (as `shardfuse
    simulate` does): not D devices sharing the host's one engine."""
    if isinstance(rates, str):
        if rates not in DEFAULTS:
            raise ValueError(f"rates={rates!r}: the built-in rates are {sorted(DEFAULTS)}")
        rates = DEFAULTS[rates]
    if rates is None:
        key = machine_key(mesh)
        rates = load(key) or defaults_for(key)
    if not rates.serial and not backend_of(mesh).ordinals:
        return rates, 1, 1
    return (rates,) + engines(mesh)
