"""CPU feature levels: which kernels and matmul paths a worker may use on this CPU.

A worker picks one level at start (the best this CPU has, or a lower one forced by
`--cpu-level` / `SPLITSERVE_CPU_LEVEL`, which is how tests cover every level on any machine)
and logs it. The C kernels are then built for that level's explicit `-march`, never
`-march=native`, so a kernel built for a level runs on every CPU that has the level, and a
forced lower level really runs the lower level's code.

| level | x86-64 features | matmuls | C kernels |
|---|---|---|---|
| `avx512_bf16` | AVX-512 F/BW/DQ/VL/CD, AVX512-BF16 | bf16: VDPBF16PS, oneDNN | 16 lanes |
| `avx512` | AVX-512 F/BW/DQ/VL/CD (x86-64-v4) | FMA (gemm_fma.c) | 16 lanes |
| `avx2` | AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE (x86-64-v3) | FMA (gemm_fma.c) | 8 lanes |
| `none` | anything else, or kernels off | torch | none (torch twins) |
"""

import enum
import platform
from pathlib import Path

ENV_VAR = "SPLITSERVE_CPU_LEVEL"


class CpuLevel(enum.IntEnum):
    NONE = 0
    AVX2 = 1
    AVX512 = 2
    AVX512_BF16 = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def march(self) -> tuple[str, ...]:
        """GCC flags that target exactly this level."""
        return _MARCH[self]

    @property
    def lanes(self) -> int:
        """float32 lanes of one vector register."""
        return 16 if self >= CpuLevel.AVX512 else 8

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 dot products run natively (else bf16 computes in float32)."""
        return self is CpuLevel.AVX512_BF16

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


_MARCH: dict[CpuLevel, tuple[str, ...]] = {
    CpuLevel.NONE: (),
    CpuLevel.AVX2: ("-march=x86-64-v3",),
    CpuLevel.AVX512: ("-march=x86-64-v4",),
    CpuLevel.AVX512_BF16: ("-march=x86-64-v4", "-mavx512bf16"),
}

# /proc/cpuinfo flags each level needs on top of the one below it (x86-64-v3 and -v4 as GCC
# defines them; "abm" is how Linux names LZCNT).
_REQUIRED_FLAGS: dict[CpuLevel, frozenset[str]] = {
    CpuLevel.AVX2: frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}),
    CpuLevel.AVX512: frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    CpuLevel.AVX512_BF16: frozenset({"avx512_bf16"}),
}


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


def detect_level(flags: frozenset[str] | None = None) -> CpuLevel:
    """The highest level whose features this CPU (or `flags`) has."""
    if flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return CpuLevel.NONE
        flags = cpu_flags()
    best = CpuLevel.NONE
    for level in (CpuLevel.AVX2, CpuLevel.AVX512, CpuLevel.AVX512_BF16):
        if not _REQUIRED_FLAGS[level] <= flags:
            break
        best = level
    return best


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


def describe(level: CpuLevel) -> str:
    """One log line: the CPU, the level and what it selects."""
    return (f"CPU {cpu_model()!r}: kernel level {level.label} (detected "
            f"{detect_level().label}); bfloat16 "
            f"{'native' if level.native_bf16 else 'computed in float32'}")
