"""Fast BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel carries a reference BLAS. `libmlx.so` leaves `cblas_sgemm`
undefined and the dynamic linker looks in the global scope before the library's own
dependencies, so loading OpenBLAS with RTLD_GLOBAL *before* `mlx.core` is first
imported reroutes every float32 matmul to it (measured ~15x on a 2048^2 matmul here;
see engine/README.md). After `mlx.core` is loaded it is too late: its symbols are
already bound, so `enable()` then only reports why it did nothing.

- KVPACK_BLAS=off disables it; KVPACK_BLAS=/path/libopenblas.so.0 picks a library.
- OpenBLAS's DYNAMIC_ARCH probe reads the CPU model, and on virtual CPUs with a generic
  model name it falls back to SSE3 "Prescott" kernels (6x slower here). Unless the user
  set OPENBLAS_CORETYPE, we set it from the instruction-set flags in /proc/cpuinfo.
- After each call OpenBLAS's worker threads spin for 2^28 cycles (about 0.1 s here)
  before they sleep, each holding a core the server's other threads and a local store
  need: a durable restore from SeaweedFS that followed the previous request's decode
  took 29-39 ms against 24-27 ms with a pause between requests (engine/README.md).
  Unless the user set OPENBLAS_THREAD_TIMEOUT, we set 2^24 cycles (a few ms): long
  enough to span the gaps between one decode step's matmuls (shorter spins cost decode
  ~10% here in wake-ups), short enough to be over before the next request.
- BlasStatus: which library serves `cblas_sgemm` in this process and how it got there.
  It enters the identity's `compute` component: another BLAS rounds differently, so
  its KV planes are not bit-identical to ours.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from dataclasses import dataclass

ENV = "KVPACK_BLAS"
THREAD_TIMEOUT = 24  # log2 of the cycles an idle OpenBLAS worker spins (its default: 28)
_OFF = {"off", "0", "false", "no", "none"}
# Debian/Ubuntu's libopenblas0-pthread (infra/install-blas.sh), then other usual homes.
CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
)


@dataclass(frozen=True)
class BlasStatus:
    library: str | None  # the OpenBLAS now in the global scope, or None (MLX's bundled BLAS)
    how: str  # "ctypes" | "ld_preload" | "bundled"
    reason: str  # one line for humans
    config: str | None = None  # openblas_get_config(), e.g. "OpenBLAS 0.3.21 ... Haswell"

    @property
    def fast(self) -> bool:
        return self.library is not None

    def fingerprint(self) -> str:
        """What of the BLAS decides the numerics: library, version and kernel family."""
        if not self.fast:
            return "bundled"
        parts = (self.config or "openblas").split()
        return " ".join(p for p in parts if not p.startswith("MAX_THREADS"))


_status: BlasStatus | None = None


def find_library() -> str | None:
    choice = os.environ.get(ENV, "").strip()
    if choice and choice.lower() not in _OFF and choice.lower() != "auto":
        return choice if os.path.exists(choice) else None
    for pattern in CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


def coretype_from_flags(flags: set[str]) -> str | None:
    """The OpenBLAS kernel family these x86 CPU flags can run (None: let OpenBLAS probe)."""
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    if "avx" in flags:
        return "SandyBridge"
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _global_sgemm_provider() -> str | None:
    """The library `cblas_sgemm` resolves to in the global scope (what libmlx binds to)."""
    try:
        addr = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    info = DlInfo()
    libdl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
    if not libdl.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
        return "unknown"
    return info.dli_fname.decode()


def _openblas_config() -> str | None:
    try:
        fn = ctypes.CDLL(None).openblas_get_config
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    return fn().decode(errors="replace").strip()


def enable() -> BlasStatus:
    """Load OpenBLAS globally if we can and should; idempotent; never raises."""
    global _status
    if _status is not None:
        return _status
    _status = _enable()
    return _status


def _enable() -> BlasStatus:
    provider = _global_sgemm_provider()
    if provider is not None:  # LD_PRELOAD (or an earlier RTLD_GLOBAL load) got there first
        return BlasStatus(
            provider, "ld_preload", "a BLAS was already preloaded", _openblas_config()
        )
    if not sys.platform.startswith("linux"):
        return BlasStatus(None, "bundled", f"not Linux ({sys.platform}): MLX's own BLAS")
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return BlasStatus(None, "bundled", f"disabled by {ENV}=off")
    if "mlx.core" in sys.modules:
        return BlasStatus(None, "bundled", "mlx.core was imported before engine: too late")
    path = find_library()
    if path is None:
        return BlasStatus(
            None, "bundled", "no OpenBLAS found (apt-get install libopenblas0-pthread)"
        )
    # Read by OpenBLAS's constructor, so they must be in the environment before the load.
    if "OPENBLAS_CORETYPE" not in os.environ and (core := coretype_from_flags(_cpu_flags())):
        os.environ["OPENBLAS_CORETYPE"] = core
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(THREAD_TIMEOUT))
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return BlasStatus(None, "bundled", f"could not load {path}: {e}")
    provider = _global_sgemm_provider()
    if provider is None:
        return BlasStatus(None, "bundled", f"{path} does not export cblas_sgemm")
    return BlasStatus(provider, "ctypes", f"loaded {path} before mlx.core", _openblas_config())


def status() -> BlasStatus:
    return enable() if _status is None else _status
