"""engine.blas: OpenBLAS preloaded via ctypes before mlx.core really serves MLX's sgemm.

Each case runs in a fresh interpreter, since the preload only works before mlx.core loads.
Rerouting is proven by results, not timings: OpenBLAS rounds differently from MLX's
bundled reference BLAS, so the same matmul gives other bits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.blas import THREAD_TIMEOUT, coretype_from_flags, find_library

ROOT = Path(__file__).resolve().parents[2]
HAVE_OPENBLAS = sys.platform.startswith("linux") and find_library() is not None

_PROBE = """
import hashlib, json, os, sys
if sys.argv[1] == "mlx-first":
    import mlx.core
import engine
import mlx.core as mx
from engine.blas import status
a = mx.random.normal((256, 256), key=mx.random.key(0))
c = a @ a.T
mx.eval(c)
import numpy as np
a64 = np.array(a, dtype=np.float64)
err = float(np.max(np.abs(np.array(c, dtype=np.float64) - a64 @ a64.T)))
st = status()
print(json.dumps({"fast": st.fast, "how": st.how, "reason": st.reason,
                  "fingerprint": st.fingerprint(), "library": st.library,
                  "matmul": hashlib.sha256(memoryview(c)).hexdigest(), "max_abs_err": err,
                  "thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}))
"""


def probe(order: str = "engine-first", **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVPACK_BLAS")}
    full_env.pop("OPENBLAS_CORETYPE", None)
    full_env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, order],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=full_env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not HAVE_OPENBLAS, reason="no OpenBLAS on this machine")
def test_preload_reroutes_sgemm_and_can_be_disabled():
    """Branches: ctypes preload (fast, OpenBLAS bits), KVPACK_BLAS=off (bundled bits),
    mlx.core imported first (too late: bundled bits), LD_PRELOAD set by the user (seen)."""
    fast = probe()
    off = probe(KVPACK_BLAS="off")
    late = probe("mlx-first")
    preloaded = probe(LD_PRELOAD=find_library())
    assert fast["fast"] and fast["how"] == "ctypes" and "openblas" in fast["library"].lower()
    assert not off["fast"] and off["fingerprint"] == "bundled" and "KVPACK_BLAS" in off["reason"]
    assert not late["fast"] and "too late" in late["reason"]
    assert preloaded["fast"] and preloaded["how"] == "ld_preload"
    assert fast["matmul"] != off["matmul"]  # another library computed it
    assert late["matmul"] == off["matmul"]
    # Other bits, not wrong results: the kernels picked from the CPU flags stay within
    # float32 rounding of a float64 reference (some OpenBLAS builds miscompute on some CPUs).
    assert fast["max_abs_err"] < 1e-3 and off["max_abs_err"] < 1e-3
    assert fast["fingerprint"].startswith("OpenBLAS") and "MAX_THREADS" not in fast["fingerprint"]
    # Idle workers spin 2^24 cycles, not OpenBLAS's 2^28, set before the load; not
    # when the library was never loaded by us.
    assert fast["thread_timeout"] == str(THREAD_TIMEOUT) and off["thread_timeout"] is None


@pytest.mark.skipif(not HAVE_OPENBLAS, reason="no OpenBLAS on this machine")
def test_user_coretype_wins_and_missing_library_falls_back():
    """OPENBLAS_CORETYPE and OPENBLAS_THREAD_TIMEOUT from the user are kept; KVPACK_BLAS
    naming a missing file falls back to the bundled BLAS instead of failing."""
    forced = probe(OPENBLAS_CORETYPE="Prescott", OPENBLAS_THREAD_TIMEOUT="28")
    assert forced["fast"] and "Prescott" in forced["fingerprint"]
    assert forced["thread_timeout"] == "28"
    missing = probe(KVPACK_BLAS="/nonexistent/libopenblas.so.0")
    assert not missing["fast"] and "no OpenBLAS" in missing["reason"]


def test_coretype_from_flags():
    """AVX-512 (F/BW/DQ/VL) -> SkylakeX, AVX2+FMA -> Haswell, AVX -> SandyBridge, else probe."""
    avx512 = {"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
    assert coretype_from_flags(avx512) == "SkylakeX"
    assert coretype_from_flags(avx512 - {"avx512vl"}) == "Haswell"
    assert coretype_from_flags({"avx", "avx2", "fma"}) == "Haswell"
    assert coretype_from_flags({"avx", "avx2"}) == "SandyBridge"
    assert coretype_from_flags({"sse4_2"}) is None


def test_identity_carries_the_blas():
    """The compute component names the BLAS, so states computed with another BLAS (other
    rounding) never share an identity with ours."""
    from engine.blas import status
    from engine.models import load_model

    compute = load_model("tiny").identity.components["compute"]
    assert compute["blas"] == status().fingerprint()
    assert set(compute) == {"device", "blas", "mlx"}
