"""CPU feature levels: which kernels and matmul paths a worker may use on this CPU.

A worker picks one level at start (the best this CPU has, or a lower one forced by
`--cpu-level` / `SPLITSERVE_CPU_LEVEL`, which is how tests cover every level on any machine)
and logs it. The C kernels are then built for that level's explicit instruction-set flags,
never `-march=native`, so a kernel built for a level runs on every CPU that has the level, and a
forced lower level really runs the lower level's code.

| level | x86-64 features | matmuls | C kernels |
|---|---|---|---|
| `amx` | AMX-TILE, AMX-BF16 + `avx512_bf16`, tiles granted | bf16: oneDNN on tiles | 16 lanes |
| `avx512_bf16` | AVX-512 F/BW/DQ/VL/CD, AVX512-BF16 | bf16: VDPBF16PS, oneDNN | 16 lanes |
| `avx512` | AVX-512 F/BW/DQ/VL/CD (x86-64-v4) | FMA (gemm_fma.c) | 16 lanes |
| `avx2` | AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE (x86-64-v3) | FMA (gemm_fma.c) | 8 lanes |
| `none` | anything else, or kernels off | torch | none (torch twins) |

AMX's tile registers are state Linux gives a process only when it asks (`arch_prctl`
ARCH_REQ_XCOMP_PERM, Linux 5.16 and later): `detect_level` asks, and a process that is refused
(an older kernel, a seccomp filter, a hypervisor that hides the state) runs one level lower and
logs why.

oneDNN (torch's bfloat16 matmuls) picks its own instruction set; `onednn_isa_cap` names the
cap a worker sets before its first matmul (`ONEDNN_MAX_CPU_ISA`), so that a forced lower level
does not run AMX tiles through oneDNN.
"""

import ctypes
import enum
import functools
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

ENV_VAR = "SPLITSERVE_CPU_LEVEL"

log = logging.getLogger(__name__)


class CpuLevel(enum.IntEnum):
    NONE = 0
    AVX2 = 1
    AVX512 = 2
    AVX512_BF16 = 3
    AMX = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def march(self) -> tuple[str, ...]:
        """Compiler flags (GCC's, which clang shares) that target exactly this level."""
        return _MARCH[self]

    @property
    def lanes(self) -> int:
        """float32 lanes of one vector register."""
        return 16 if self >= CpuLevel.AVX512 else 8

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 dot products run natively (else bf16 computes in float32)."""
        return self >= CpuLevel.AVX512_BF16

    @property
    def onednn_isa_cap(self) -> str:
        """The `ONEDNN_MAX_CPU_ISA` value that keeps oneDNN within this level."""
        return _ONEDNN_ISA[self]

    @classmethod
    def parse(cls, text: str) -> "CpuLevel | None":
        """A level by its label; None for "auto" or ""; ValueError for anything else."""
        text = text.strip().lower()
        if text in ("", "auto"):
            return None
        for level in cls:
            if level.label == text:
                return level
        raise ValueError(f"unknown CPU level {text!r}: expected auto or one of "
                         f"{', '.join(level.label for level in cls)}")


# x86-64-v3 and -v4 spelled out feature by feature: GCC before 11 and clang before 12 do not
# know those -march names; the feature flags are far older. GCC 12 emits the same
# instructions for both spellings (every kernel compared with objdump).
_V3 = ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mmovbe", "-mpopcnt",
       "-msse4.2", "-mssse3", "-mcx16", "-msahf", "-mxsave")
_V4 = (*_V3, "-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl")

_MARCH: dict[CpuLevel, tuple[str, ...]] = {
    CpuLevel.NONE: (),
    CpuLevel.AVX2: _V3,
    CpuLevel.AVX512: _V4,
    CpuLevel.AVX512_BF16: (*_V4, "-mavx512bf16"),
    CpuLevel.AMX: (*_V4, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
}

# oneDNN's names (its ISA dispatcher's): below AVX-512 oneDNN's bf16 matmul is not used at all.
_ONEDNN_ISA: dict[CpuLevel, str] = {
    CpuLevel.NONE: "SSE41",
    CpuLevel.AVX2: "AVX2",
    CpuLevel.AVX512: "AVX512_CORE",
    CpuLevel.AVX512_BF16: "AVX512_CORE_BF16",
    CpuLevel.AMX: "AVX512_CORE_AMX",
}

# /proc/cpuinfo flags each level needs on top of the one below it (x86-64-v3 and -v4 as GCC
# defines them; "abm" is how Linux names LZCNT).
_REQUIRED_FLAGS: dict[CpuLevel, frozenset[str]] = {
    CpuLevel.AVX2: frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}),
    CpuLevel.AVX512: frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    CpuLevel.AVX512_BF16: frozenset({"avx512_bf16"}),
    CpuLevel.AMX: frozenset({"amx_tile", "amx_bf16"}),
}

# arch_prctl(2) on x86-64: ask for the AMX tile data state (XFEATURE_XTILEDATA = 18).
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpuinfo_lines(*prefixes: str) -> list[str]:
    """The distinct /proc/cpuinfo lines starting with these prefixes ([] where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return sorted({line for line in text.splitlines() if line.startswith(prefixes)})


def cpu_flags() -> frozenset[str]:
    """The feature flags every core reports (empty off Linux)."""
    sets = [set(line.split(":", 1)[1].split()) for line in cpuinfo_lines("flags")]
    return frozenset(set.intersection(*sets)) if sets else frozenset()


def cpu_model() -> str:
    names = [line.split(":", 1)[1].strip() for line in cpuinfo_lines("model name")]
    return names[0] if names else platform.processor() or platform.machine()


@functools.cache
def request_amx() -> str | None:
    """Asks Linux for this process's AMX tile state; None once granted, else why not. The
    grant is for the whole process and its later threads, so one call is enough."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"AMX is x86-64 only, this is {platform.machine()}"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        done = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                            ctypes.c_long(_XFEATURE_XTILEDATA))
    except (OSError, AttributeError) as e:
        return f"arch_prctl could not be called: {e}"
    if done != 0:
        errno = ctypes.get_errno()
        return (f"Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: "
                f"{os.strerror(errno)}; Linux 5.16 or later grants it)")
    return None


def detect_level(flags: frozenset[str] | None = None,
                 amx_refusal: Callable[[], str | None] = request_amx) -> CpuLevel:
    """The highest level whose features this CPU (or `flags`) has. AMX also needs the tile
    state from Linux (`amx_refusal`: None when granted, else the reason, logged once per
    reason); without it the level is avx512_bf16."""
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return CpuLevel.NONE
        flags = cpu_flags()
    best = CpuLevel.NONE
    for level in (CpuLevel.AVX2, CpuLevel.AVX512, CpuLevel.AVX512_BF16, CpuLevel.AMX):
        if not _REQUIRED_FLAGS[level] <= flags:
            break
        if level is CpuLevel.AMX and (reason := amx_refusal()) is not None:
            _warn_once(f"CPU has AMX tiles but runs level avx512_bf16: {reason}")
            break
        best = level
    return best


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def select_level(requested: str = "auto") -> CpuLevel:
    """The level a worker runs at: `requested` ("auto": the best detected). A level above what
    the CPU has is refused: its code would die on an illegal instruction."""
    detected = detect_level()
    wanted = CpuLevel.parse(requested)
    if wanted is None:
        return detected
    if wanted > detected:
        raise ValueError(f"CPU level {wanted.label} requested, but this CPU ({cpu_model()}) "
                         f"supports at most {detected.label}")
    return wanted


def cap_onednn(level: CpuLevel) -> None:
    """Keeps oneDNN within `level` (a forced avx512_bf16 must not run AMX tiles through torch's
    bf16 matmuls). oneDNN reads the cap at its first matmul, so this is called before any;
    a cap already in the environment (the operator's) stays."""
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", level.onednn_isa_cap)


def describe(level: CpuLevel) -> str:
    """One log line: the CPU, the level and what it selects."""
    return (f"CPU {cpu_model()!r}: kernel level {level.label} (detected "
            f"{detect_level().label}); bfloat16 "
            f"{'native' if level.native_bf16 else 'computed in float32'}")
