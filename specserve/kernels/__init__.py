"""Native CPU kernels, compiled on first use with the system C compiler and loaded by ctypes.

The shared object lands in `cache_dir()/kernels/`, named by a hash of the source and flags, so
an edit rebuilds it and a second process reuses it. One is loaded only if this user owns it
and no one else can write it (`paths.untrusted`); any other is rebuilt over, and a kernel
folder that others could write to, or one under a folder others could replace it from
(`paths.untrusted_folder`), is not used at all (PyTorch's kernels run instead). A library is
opened without following links, checked on the descriptor, and loaded from that descriptor
(`load_library`), so the file loaded is the file checked. It links the same OpenMP runtime as
PyTorch (`libgomp.so.1`, already loaded by `import torch`), so `torch.set_num_threads` also
sets the kernels' thread count and the two never compete with separate thread pools.

Instruction sets, chosen at run time from /proc/cpuinfo, widest first:
- `avx512_vnni`: AVX-512 F, BW, CD, DQ, VL and VNNI on top of the AVX2 set (Zen 4, Ice Lake
  and later);
- `avx2`: AVX2, FMA and F16C (Haswell, Zen 1-3);
- None: anything else; callers fall back to PyTorch's own kernels.
`SPECSERVE_KERNEL_ISA=avx2` (or `avx512_vnni`, alias `avx512`) forces one that the CPU has;
`SPECSERVE_NO_NATIVE=1` forces PyTorch. Each set builds the same source with its own flags
into its own shared object; the quantized and float matmuls give the same bits on each.

`qmatmul()` returns the loaded library (quantized weight matmuls `q_matmul`, float weight
matmul `f_matmul`, a projection of one or more parts `proj_run`), or None where it cannot run here (no compiler, no AVX2/FMA/F16C, or
`SPECSERVE_NO_NATIVE`); `isa()` says which instruction set it was built for.
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

import torch

from specserve.kernels import decoder
from specserve.paths import cache_dir, make_dirs, open_trusted, untrusted, untrusted_folder

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.c")
FLAGS = ["-O3", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# Each instruction set the matmul kernels build for, widest first: the CPU flags it needs and
# its compiler flags. No floating-point contraction: the kernels' reduction order is theirs,
# the same in every build.
ISAS = {
    "avx512_vnni": (REQUIRED_CPU_FLAGS + ("avx512f", "avx512bw", "avx512cd", "avx512dq",
                                          "avx512vl", "avx512_vnni"),
                    ["-march=x86-64-v4", "-mavx512vnni"]),
    "avx2": (REQUIRED_CPU_FLAGS, ["-march=x86-64-v3"]),
}
ISA_ALIASES = {"avx512": "avx512_vnni"}
ISA_CODES = {"avx2": 1, "avx512_vnni": 2}  # what the library's q_isa() returns
# The KV pools' element kinds `ragged_attention` and `rope_store_attend` take (attention.c's
# KV_F32, KV_F16, KV_BF16)
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty off x86-64 or without it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def cpu_supported() -> bool:
    return all(f in cpu_flags() for f in REQUIRED_CPU_FLAGS)


def available_isas() -> tuple[str, ...]:
    """The instruction sets this CPU can run, widest first."""
    return tuple(name for name, (needs, _) in ISAS.items() if all(f in cpu_flags() for f in needs))


def isa() -> str | None:
    """The instruction set the native kernels use here: the widest this CPU has, or the one
    `SPECSERVE_KERNEL_ISA` names; None with `SPECSERVE_NO_NATIVE` or on other CPUs."""
    if os.environ.get("SPECSERVE_NO_NATIVE"):
        return None
    forced = os.environ.get("SPECSERVE_KERNEL_ISA", "").strip().lower()
    if forced:
        name = ISA_ALIASES.get(forced, forced)
        if name not in ISAS:
            raise ValueError(f"SPECSERVE_KERNEL_ISA must be one of "
                             f"{sorted([*ISAS, *ISA_ALIASES])}, got {forced!r}")
        if name not in available_isas():
            raise ValueError(f"SPECSERVE_KERNEL_ISA={forced!r}: this CPU lacks one of "
                             f"{ISAS[name][0]}")
        return name
    found = available_isas()
    return found[0] if found else None


def build(source: Path = SOURCE, out_dir: Path | None = None,
          flags: list[str] | None = None) -> Path:
    """Compile `source` with `flags` (default FLAGS) into a shared object, once per source and
    flags; returns its path."""
    flags = FLAGS if flags is None else flags
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = out_dir if out_dir is not None else cache_dir() / "kernels"
    target = out_dir / f"{source.stem}-{digest}.so"
    make_dirs(out_dir)
    if (problem := untrusted_folder(out_dir)) is not None:
        raise RuntimeError(f"the kernel folder: {problem}: not loading code from it")
    if target.exists():
        if (problem := untrusted(target)) is None:
            return target
        log.warning("kernel library %s is %s; rebuilding it", target, problem)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename atomically
        partial = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, str(source), "-o", str(partial), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{result.stderr.strip()}")
        os.chmod(partial, 0o755)  # whatever the umask: writable by this user only
        os.replace(partial, target)
    return target


def load_library(path: Path) -> ctypes.CDLL:
    """The shared object at `path`, loaded from the descriptor `paths.open_trusted` checked
    (through /proc/self/fd where there is one); `UntrustedPath` (an OSError) when it is not
    this user's alone, OSError when it is a link or cannot be opened. The descriptor stays
    open while the process lives: the loader knows a library by the name it was opened under,
    and a closed descriptor's number, reused for the next library, would name this one."""
    fd = open_trusted(path)
    proc = Path(f"/proc/self/fd/{fd}")
    if not proc.exists():
        os.close(fd)
        return ctypes.CDLL(str(path))
    try:
        return ctypes.CDLL(str(proc))
    except OSError:
        os.close(fd)
        raise


def isa_flags(name: str) -> list[str]:
    """Compiler flags of the matmul kernels for instruction set `name` (a key of ISAS)."""
    return [f for f in FLAGS if not f.startswith("-march=")] + ISAS[name][1] + [
        "-ffp-contract=off"]


@functools.cache
def _load_qmatmul(name: str, source: Path = SOURCE) -> ctypes.CDLL | None:
    try:
        lib = load_library(build(source, flags=isa_flags(name)))
    except (RuntimeError, OSError) as err:
        log.warning("native %s matmul kernels unavailable (%s); using PyTorch's", name, err)
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    # kind, x, rows, k, sb, ab, zero, qs, qh, sc, dsup, mins, dmin, n, y, ldy, path (layout v4)
    lib.q_matmul.argtypes = [c_int, p, i64, i64, i64, i64, ctypes.c_int32, p, p, p, p, p, p,
                             i64, p, i64, c_int]
    lib.q_matmul.restype = c_int
    lib.q_sc_max.argtypes = [c_int]
    lib.q_sc_max.restype = c_int
    lib.q_isa.argtypes = []
    lib.q_isa.restype = c_int
    lib.f_matmul.argtypes = [p, i64, i64, p, c_int, p, i64, p]
    lib.f_matmul.restype = c_int
    decoder.bind_matmul(lib)
    if lib.q_isa() != ISA_CODES[name]:
        raise RuntimeError(f"the {name} build of {source.name} reports instruction set "
                           f"{lib.q_isa()}")
    return lib


def _resolve(name: str | None) -> str | None:
    """`name` (an alias allowed) or, for None, `isa()`; an instruction set this CPU lacks is an
    error."""
    name = isa() if name is None else ISA_ALIASES.get(name, name)
    if name is not None and name not in available_isas():
        raise ValueError(f"instruction set {name!r} is not one this CPU runs "
                         f"({available_isas()})")
    return name


def qmatmul(name: str | None = None) -> ctypes.CDLL | None:
    """The matmul kernels built for instruction set `name` (default: `isa()`), or None where
    they cannot run here."""
    name = _resolve(name)
    return None if name is None else _load_qmatmul(name)


@functools.cache
def _load_attention(name: str) -> ctypes.CDLL | None:
    try:
        lib = load_library(build(Path(__file__).with_name("attention.c"), flags=isa_flags(name)))
    except (RuntimeError, OSError) as err:
        log.warning("native %s attention kernel unavailable (%s); using PyTorch's", name, err)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    # the pools' element kind (`KV_KINDS`) follows the two pool pointers
    lib.ragged_attention.argtypes = [p, i64, i64, i64, i64, p, p, i64, i64, i64, p, i64, i64, p,
                                     p, ctypes.c_float, p]
    lib.ragged_attention.restype = ctypes.c_int
    lib.rope_store_attend.argtypes = [p, i64, i64, i64, i64, p, p, p, p, i64, i64, i64, p, i64,
                                      i64, p, p, ctypes.c_float, p]
    lib.rope_store_attend.restype = ctypes.c_int
    lib.rms_norm.argtypes = [p, i64, i64, p, ctypes.c_float, p]
    lib.rms_norm.restype = ctypes.c_int
    lib.silu_mul.argtypes = [p, i64, i64, p]
    lib.silu_mul.restype = ctypes.c_int
    decoder.bind_glue(lib)
    return lib


def attention(name: str | None = None) -> ctypes.CDLL | None:
    """The ragged paged attention kernel (`attention.c`, `ragged_attention`), the rest of a
    decoder layer's per-row work (`rope_store_attend`, `rms_norm`, `silu_mul`) and the whole
    pass in one call (`decoder_pass`, see `kernels/decoder.py`), built for
    instruction set `name` (default: `isa()`; every build gives the same bits), or None where
    they cannot run here."""
    name = _resolve(name)
    return None if name is None else _load_attention(name)
