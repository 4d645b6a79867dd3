"""Native CPU kernels, compiled on first use with the system C compiler and loaded by ctypes.

The shared object lands in `cache_dir()/kernels/`, named by a hash of the source and flags, so
an edit rebuilds it and a second process reuses it. It links the same OpenMP runtime as
PyTorch (`libgomp.so.1`, already loaded by `import torch`), so `torch.set_num_threads` also
sets the kernels' thread count and the two never compete with separate thread pools.

`qmatmul()` returns the loaded library (4- and 8-bit weight matmuls), or None where it cannot
run here (no compiler, or a CPU without AVX2/FMA/F16C); callers then fall back to PyTorch's own
kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from specserve.models.registry import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
FLAGS = ["-O3", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")


def cpu_supported() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return all(f in flags for f in REQUIRED_CPU_FLAGS)


def build(source: Path = SOURCE, out_dir: Path | None = None) -> Path:
    """Compile `source` into a shared object (once per source and flags); returns its path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out_dir = out_dir if out_dir is not None else cache_dir() / "kernels"
    target = out_dir / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename atomically
        partial = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(partial), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{result.stderr.strip()}")
        os.replace(partial, target)
    return target


@functools.cache
def qmatmul() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_NO_NATIVE"):
        return None
    if not cpu_supported():
        log.info("native quantized kernels: CPU lacks one of %s; using PyTorch's",
                 REQUIRED_CPU_FLAGS)
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as err:
        log.warning("native quantized kernels unavailable (%s); using PyTorch's", err)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.q_matmul.argtypes = [ctypes.c_int, p, i64, i64, i64, p, p, p, p, i64, p]
    lib.q_matmul.restype = ctypes.c_int
    lib.q_sc_max.argtypes = [ctypes.c_int]
    lib.q_sc_max.restype = ctypes.c_int
    return lib
