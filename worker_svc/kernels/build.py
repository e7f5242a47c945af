"""Compiling the C kernels on the worker's machine, once, and loading them with ctypes.

The compiler is `$CC`, else `cc`, else `gcc`. GCC 11 and later, and clang 14 (with LLVM's
OpenMP, Debian's libomp-dev), build every kernel at every level;
tests/worker_svc/test_kernel_build.py builds them with every compiler on PATH. A compiler
that cannot target a level at all (too old for its flags or intrinsics, or without OpenMP)
fails with `UnsupportedLevel`, which names the compiler, its version and the level.

A build is cached under `$SPLITSERVE_KERNEL_DIR` (default `~/.cache/splitserve/kernels`),
named by a hash of the source, its headers, the flags (the CPU level's among them) and the
compiler (its path and `--version`). The flags name the instruction set exactly, so a cache
shared by machines of one level is safe. Builds are written to a temporary file and renamed,
so workers starting together do not collide.

A worker calls `usable_level` at start: it builds every kernel at its level and, where one does
not build, logs a warning with the compiler's error and goes down a level, so the level the
worker reports is the code it runs. Later a build that still fails (a model shape no kernel
takes) makes `build` return None with one warning; the caller uses the torch twin (same
results, slower).

The kernels use OpenMP through the libgomp torch already loaded (same soname), so
`torch.set_num_threads` sizes their thread pool too; clang's builds use LLVM's libomp, a pool
of its own.
"""

import ctypes
import functools
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

# One use of each level's newest intrinsics, and of OpenMP: what a compiler must have before
# any kernel of the level can build (its flags are checked by compiling it with them).
_PROBE_HEADER = "#include <immintrin.h>\n#include <omp.h>\nint threads(void) " \
                "{ return omp_get_max_threads(); }\n"
_PROBES: dict[CpuLevel, str] = {
    CpuLevel.AVX2: "__m256 avx2(__m256 a) { return _mm256_fmadd_ps(a, a, a); }",
    CpuLevel.AVX512: "__m512 avx512(__m512 a) { return _mm512_fmadd_ps(a, a, a); }",
    CpuLevel.AVX512_BF16:
        "__m512 bf16(__m512 a, __m512bh b) { return _mm512_dpbf16_ps(a, b, b); }",
    CpuLevel.AMX: "void amx(void) { _tile_release(); }",
}


class UnsupportedLevel(RuntimeError):
    """The compiler cannot build any kernel at this level (it lacks the level's flags or
    intrinsics, or OpenMP)."""


def level_builds(level: CpuLevel) -> list[tuple[str, dict[str, int]]]:
    """Every kernel source a worker at `level` may build, with each set of defines that
    selects different code: what `usable_level` checks and the tests build. The attention
    kernel's shape (HEAD_DIM, GROUP) is a typical model's; the model's own is built at load."""
    if level is CpuLevel.NONE:
        return []
    builds: list[tuple[str, dict[str, int]]] = [
        ("elementwise.c", {"ELEM_BF16": 1}), ("elementwise.c", {"ELEM_BF16": 0}),
        ("paged_attention.c", {"HEAD_DIM": 64, "GROUP": 3, "LANES": level.lanes,
                               "ELEM_BF16": 1}),
        # an 8-bit KV cache (kv_quant): e4m3 under bfloat16, e5m2 under float32
        ("paged_attention.c", {"HEAD_DIM": 64, "GROUP": 3, "LANES": level.lanes,
                               "ELEM_BF16": 1, "KV_FP8": 1}),
        ("paged_attention.c", {"HEAD_DIM": 64, "GROUP": 3, "LANES": level.lanes,
                               "ELEM_BF16": 0, "KV_FP8": 2}),
        ("gemm_fma.c", {"ELEM_BF16": 1, "W_BF16": 1}),
        ("gemm_fma.c", {"ELEM_BF16": 0, "W_BF16": 0}),
        ("gemm_quant.c", {"ELEM_BF16": 1, "BITS": 4}),
        ("gemm_quant.c", {"ELEM_BF16": 0, "BITS": 8})]
    if level.native_bf16:
        builds += [("gemm_bf16.c", {}), ("gemm_int8.c", {})]
    if level >= CpuLevel.AMX:
        builds += [("gemm_amx.c", {}), ("gemm_amx_quant.c", {}), ("gemm_int8_amx.c", {}),
                   ("paged_attention_amx.c", {"HEAD_DIM": 64, "GROUP": 3, "ELEM_BF16": 1}),
                   ("paged_attention_amx.c", {"HEAD_DIM": 64, "GROUP": 3, "ELEM_BF16": 1,
                                              "KV_FP8": 1})]
    return builds


def find_compiler(compiler: str | None = None) -> str:
    """`compiler`, else `$CC`, else `cc` or `gcc`, as found on PATH. A named one that is not
    found is an error, not a silent switch to another."""
    named = compiler or os.environ.get("CC")
    if named:
        if shutil.which(named) is None:
            raise RuntimeError(f"C compiler {named!r} ($CC or named) not found on PATH")
        return named
    for name in ("cc", "gcc"):
        if shutil.which(name):
            return name
    raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")


def compiler_identity(compiler: str) -> str:
    """The compiler's resolved path and `--version`: what a cached build is keyed by."""
    path = os.path.realpath(shutil.which(compiler) or compiler)
    return f"{path}\n{_version(path)}"


@functools.cache
def _version(path: str) -> str:
    return subprocess.run([path, "--version"], capture_output=True, text=True,
                          timeout=30).stdout


def compiler_version(compiler: str) -> str:
    """The first line of `--version`, for messages."""
    return compiler_identity(compiler).split("\n")[1].strip()


def unsupported_reason(compiler: str, level: CpuLevel) -> str | None:
    """Why `compiler` cannot build any kernel at `level`; None where it can."""
    return _probe(compiler_identity(compiler), compiler, level)


@functools.cache
def _probe(identity: str, compiler: str, level: CpuLevel) -> str | None:
    # `identity` keys the cache: the same name may be another compiler once PATH changes.
    if level is CpuLevel.NONE:
        return None
    source = _PROBE_HEADER + "\n".join(text for probed, text in _PROBES.items()
                                       if probed <= level)
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([compiler, *level.march, *CFLAGS, "-x", "c", "-",
                               "-o", f"{tmp}/probe.so"], input=source, capture_output=True,
                              text=True, timeout=60)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
    return next((line for line in lines if "error" in line), lines[-1]).strip()


def _flags(level: CpuLevel, defines: dict[str, int]) -> tuple[str, ...]:
    return tuple(f"-D{k}={v}" for k, v in sorted(defines.items())) + level.march + CFLAGS


def _compile(compiler: str, source: str, level: CpuLevel, defines: dict[str, int],
             out: Path | str) -> None:
    """Compile `source` for `level` into `out`; UnsupportedLevel or RuntimeError (with the
    compiler's message) on failure."""
    reason = unsupported_reason(compiler, level)
    if reason is not None:
        raise UnsupportedLevel(f"{compiler} ({compiler_version(compiler)}) cannot build CPU "
                               f"level {level.label}: {reason}")
    done = subprocess.run([compiler, *_flags(level, defines), str(SOURCE_DIR / source), "-o",
                           str(out), "-lm"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} ({compiler_version(compiler)}) failed on {source} at "
                           f"level {level.label}: {done.stderr.strip()[-2000:]}")


def compile_only(source: str, level: CpuLevel, defines: dict[str, int], out: Path,
                 compiler: str | None = None) -> None:
    """Compile without loading (tests build every level's code on any CPU), with `compiler`
    (None: as `build` picks one). Raises UnsupportedLevel or RuntimeError with the compiler's
    message on failure."""
    _compile(find_compiler(compiler), source, level, defines, out)


def usable_level(level: CpuLevel, compiler: str | None = None) -> CpuLevel:
    """The highest level up to `level` at which every kernel (`level_builds`) builds, into the
    cache that the model's builds share. Each level given up is a warning naming the kernel,
    the compiler and its error."""
    # The level is reported at registration, before the model's shapes are known, and it
    # stands for code (the kernels, oneDNN's cap, the preferred dtype): a level whose kernels
    # do not build would be a level in name only. One level down at a time, because a
    # compiler too old for AMX or AVX512-BF16 still builds the levels below.
    if level is CpuLevel.NONE:
        return level
    try:
        found = find_compiler(compiler)
    except RuntimeError as e:
        log.warning("CPU kernels cannot be built, running level none (torch for every kernel) "
                    "instead of %s: %s", level.label, e)
        return CpuLevel.NONE
    while level is not CpuLevel.NONE:
        lower = CpuLevel(level - 1)
        try:
            for source, defines in level_builds(level):
                _cached(found, source, level, defines)
            return level
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            log.warning("CPU kernels do not build at level %s, running level %s%s instead: %s",
                        level.label, lower.label,
                        " (torch for every kernel)" if lower is CpuLevel.NONE else "", e)
            level = lower
    return level


def build(source: str, level: CpuLevel, defines: dict[str, int]) -> ctypes.CDLL | None:
    """Compile `source` (a file beside this module) for `level` with `-D` defines, or take it
    from the cache; load it. None (with one warning) where that cannot be done."""
    if level is CpuLevel.NONE:
        return None
    key = (source, _flags(level, defines))
    if key in _libraries:
        return _libraries[key]
    library = None
    try:
        library = ctypes.CDLL(str(_cached(find_compiler(), source, level, defines)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        if source not in _warned:
            _warned.add(source)
            log.warning("CPU kernel %s unavailable at level %s, its torch twin runs instead: "
                        "%s", source, level.label, e)
    _libraries[key] = library
    return library


def _cache_dir() -> Path:
    configured = os.environ.get("SPLITSERVE_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "splitserve" / "kernels"


def _cached(compiler: str, source: str, level: CpuLevel, defines: dict[str, int]) -> Path:
    """The built library for these inputs, compiled into the cache unless already there."""
    path = SOURCE_DIR / source
    headers = [h.read_text() for h in sorted(path.parent.glob("*.h"))]
    digest = hashlib.sha256("\0".join([path.read_text(), *headers, *_flags(level, defines),
                                       compiler_identity(compiler)]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{path.stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            _compile(compiler, source, level, defines, tmp)
            os.replace(tmp, target)
            log.info("built CPU kernel %s", target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
