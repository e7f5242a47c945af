"""Compiling the C kernels on the worker's machine, once, and loading them with ctypes.

A build is cached under `$SPLITSERVE_KERNEL_DIR` (default `~/.cache/splitserve/kernels`),
named by a hash of the source, its headers, the flags (the CPU level's `-march` among them)
and the compiler's version. The flags name the instruction set exactly, so a cache shared by
machines of one level is safe. Builds are written to a temporary file and renamed, so workers
starting together do not collide.

Where there is no C compiler or a build fails, `build` returns None and logs why once; the
caller then uses the torch twin (same results, slower).

The kernels use OpenMP through the libgomp torch already loaded (same soname), so
`torch.set_num_threads` sizes their thread pool too.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from worker_svc.kernels.cpu import CpuLevel

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

_libraries: dict[tuple[str, tuple[str, ...]], ctypes.CDLL | None] = {}
_warned: set[str] = set()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    configured = os.environ.get("SPLITSERVE_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "splitserve" / "kernels"


def _flags(level: CpuLevel, defines: dict[str, int]) -> tuple[str, ...]:
    return tuple(f"-D{k}={v}" for k, v in sorted(defines.items())) + level.march + CFLAGS


def build(source: str, level: CpuLevel, defines: dict[str, int]) -> ctypes.CDLL | None:
    """Compile `source` (a file beside this module) for `level` with `-D` defines, or take it
    from the cache; load it. None (with one warning) where that cannot be done."""
    if level is CpuLevel.NONE:
        return None
    flags = _flags(level, defines)
    key = (source, flags)
    if key in _libraries:
        return _libraries[key]
    library = None
    try:
        library = _build(SOURCE_DIR / source, flags)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        if source not in _warned:
            _warned.add(source)
            log.warning("CPU kernel %s unavailable, using the torch path: %s", source, e)
    _libraries[key] = library
    return library


def compile_only(source: str, level: CpuLevel, defines: dict[str, int], out: Path) -> None:
    """Compile without loading (tests build every level's code on any CPU). Raises
    RuntimeError with the compiler's message on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    done = subprocess.run([compiler, *_flags(level, defines), str(SOURCE_DIR / source), "-o",
                           str(out), "-lm"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")


def _build(path: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    headers = [h.read_text() for h in sorted(path.parent.glob("*.h"))]
    digest = hashlib.sha256("\0".join([path.read_text(), *headers, *flags, version]).encode()
                            ).hexdigest()[:16]
    target = _cache_dir() / f"{path.stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, str(path), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
            log.info("built CPU kernel %s", target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))
