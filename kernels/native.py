"""Build and load the C++ CPU kernels (kernels/csrc/*.cpp) as plain shared libraries.

A library is compiled with g++ once per (source, flags, compiler) and cached
as ``build/kernels/<name>-<hash>.so`` in the repository (ignored by git); a
file lock serialises concurrent builders (tests start several daemons), and
the result is renamed into place so a reader never sees half a file. No
network, no torch headers: the sources use only the C ABI and OpenMP, so a
build takes seconds and is loaded with ``ctypes`` (which releases the GIL
while a kernel runs).

OpenMP: the library links ``libgomp.so.1``. torch is imported first and has
already loaded its own bundled ``libgomp.so.1``; the dynamic loader resolves
the same soname to that copy, so the kernels share torch's thread pool
instead of starting a second runtime whose threads would spin against it.

This module knows no kernel: each kernel module names its library and flags,
and ``python -m kernels`` (kernels/__main__.py, ``make install``) builds every
one this CPU runs.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parent / "csrc"
REPO = Path(__file__).resolve().parent.parent
AVX512_BF16_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma")
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno")
COMPILER = os.environ.get("CXX", "g++")
# Flags only GCC takes; dropped (and left out of the cache key) for any other compiler.
GCC_ONLY_FLAGS = frozenset({"-fschedule-insns", "-fsched-pressure"})


OMP_PAUSE_SOFT = 1          # omp_pause_resource_t's omp_pause_soft (omp.h)


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (``omp_pause_resource_all``
    of the libgomp torch loaded); the next parallel region on this thread starts
    a new team. True when there was a libgomp to ask and it did.

    libgomp keeps a pool per thread that has run a parallel region (torch ops
    included). When the pools' threads outnumber the CPUs it throttles every
    one of them: a worker spins ~100 times after a region, then sleeps on a
    futex, and each region wakes the team again (a decode step is one region).
    A thread that loaded a model and then only hands work to another keeps
    such a pool for nothing: releasing it leaves the stepping thread's team
    the process's only one, and its workers spin between steps."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)   # torch's, never a second
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.restype, pause.argtypes = ctypes.c_int, [ctypes.c_int]
    return pause(OMP_PAUSE_SOFT) == 0


class BuildError(RuntimeError):
    """The compiler is missing or rejected the source (the message holds its output)."""


def cache_dir() -> Path:
    """``build/kernels`` in the repository, or ``$KVD_KERNEL_CACHE`` when set."""
    return Path(os.environ.get("KVD_KERNEL_CACHE") or REPO / "build" / "kernels")


@functools.cache
def _compiler_version() -> str:
    try:
        return subprocess.run([COMPILER, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as exc:
        raise BuildError(f"no C++ compiler ({COMPILER}): {exc}") from None


def compiler_version() -> str:
    """The first line of the C++ compiler's ``--version`` (what built the kernels), or
    "none" where there is no compiler."""
    try:
        return _compiler_version()
    except BuildError:
        return "none"


def for_compiler(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` less ``GCC_ONLY_FLAGS`` when ``COMPILER`` is not GCC."""
    version = _compiler_version().lower()
    if "clang" not in version and ("gcc" in version or "g++" in version):
        return flags
    return tuple(f for f in flags if f not in GCC_ONLY_FLAGS)


def library_path(name: str, flags: tuple[str, ...]) -> Path:
    """Where ``name``'s library for ``flags`` lives: keyed on source (and every header
    in csrc/, which a source may include), flags and compiler."""
    flags = for_compiler(flags)
    src = SOURCES / f"{name}.cpp"
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    key = hashlib.sha256(src.read_bytes() + headers + " ".join(BASE_FLAGS + flags).encode()
                         + _compiler_version().encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


def build(name: str, flags: tuple[str, ...]) -> Path:
    """Compile ``csrc/<name>.cpp`` unless cached; returns the library's path.

    Safe to call from several processes at once (one compiles, the others
    wait on the lock and find the result). Raises BuildError.
    """
    out = library_path(name, flags)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{name}-", suffix=".so")
        os.close(fd)
        cmd = [COMPILER, *BASE_FLAGS, *for_compiler(flags), str(SOURCES / f"{name}.cpp"), "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
            os.replace(tmp, out)
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"{' '.join(cmd)}: {exc}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("built %s", out)
    return out


def build_many(jobs: list[tuple[str, tuple[str, ...]]]) -> list[Path]:
    """``build`` for each (name, flags), compilers run side by side (one per CPU; builds of
    the same library take turns on its lock); the paths in ``jobs``' order. Raises the
    first BuildError."""
    workers = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: build(*job), jobs))


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux grants this process the AMX tile state (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA; granted once, for the whole process). Without
    it the first tile instruction raises SIGILL, whatever /proc/cpuinfo says."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18    # x86-64 Linux
_AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "amx_complex"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags this process can use: /proc/cpuinfo's (empty where it cannot be
    read), less the AMX ones where Linux does not grant the tile state (amx_permitted).
    Read once: every kernel library's build choice asks."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    if flags & _AMX_FLAGS and not amx_permitted():
        flags -= _AMX_FLAGS
    return frozenset(flags)


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 in hardware (AVX512-BF16 or AMX-BF16, of cpu_flags)."""
    return bool(cpu_flags() & NATIVE_BF16_FLAGS)


def load(name: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    """Build if needed and load. Raises BuildError or OSError (a library that will not load)."""
    import torch  # noqa: F401  (load torch's libgomp first, see the module docstring)
    return ctypes.CDLL(str(build(name, flags)))


def require_variant(lib: ctypes.CDLL, symbol: str, library: str, variant: str) -> None:
    """Raise BuildError unless ``lib``'s ``symbol()`` (csrc/variant.h's KVD_VARIANT)
    names ``variant``: flags and source disagree, and such a library is never run."""
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_char_p
    built = fn().decode()
    if built != variant:
        raise BuildError(f"{library} built for {variant} reports {built}")

