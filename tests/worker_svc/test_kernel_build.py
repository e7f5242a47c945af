"""Every kernel builds at every level with every C compiler on PATH, or fails with the clear
`UnsupportedLevel`; a worker whose kernels do not build runs, and reports, a lower level and
says why (worker_svc.kernels.build)."""

import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from worker_svc.__main__ import parse_args
from worker_svc.kernels import build
from worker_svc.kernels.cpu import CpuLevel, detect_level

LEVELS = [CpuLevel.AVX2, CpuLevel.AVX512, CpuLevel.AVX512_BF16, CpuLevel.AMX]
# Beside the default gcc, what CI installs (.ci/run); a missing one is a skip that names it.
WANTED = ("gcc-11", "clang")


def compilers_on_path() -> list[str]:
    """cc, gcc, gcc-N, clang, clang-N on PATH, one name per compiler (the most specific)."""
    found: dict[str, list[str]] = {}
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        try:
            names = os.listdir(directory or ".")
        except OSError:
            continue
        for name in names:
            if re.fullmatch(r"cc|gcc(-\d+)?|clang(-\d+)?", name) and (path := shutil.which(name)):
                found.setdefault(os.path.realpath(path), []).append(name)
    return sorted(max(names, key=lambda n: ("-" in n, n)) for names in found.values())


def _family_version(compiler: str) -> tuple[str, int]:
    line = build.compiler_version(compiler)
    if "clang" in line:
        match = re.search(r"version (\d+)", line)
        return "clang", int(match.group(1)) if match else 0
    match = re.search(r"(\d+)\.\d+\.\d+\s*$", line)
    return "gcc", int(match.group(1)) if match else 0


def _fake_compiler(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-cc"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


_COMPILERS = compilers_on_path() + [name for name in WANTED if shutil.which(name) is None]


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.label)
@pytest.mark.parametrize("compiler", _COMPILERS)
def test_every_kernel_builds_at_every_level(compiler: str, level: CpuLevel,
                                            tmp_path: Path) -> None:
    # Built, not loaded: this is how a machine without AVX-512 or AMX still checks that code.
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} is not on PATH (CI installs it: .ci/run)")
    family, major = _family_version(compiler)
    reason = build.unsupported_reason(compiler, level)
    if reason is not None:
        if family == "clang" and "omp.h" in reason:
            pytest.skip(f"{compiler} has no OpenMP headers (Debian: libomp-dev): {reason}")
        # GCC 11 and clang 14 know every level's flags and intrinsics (the README says so).
        assert major < (11 if family == "gcc" else 14), f"{compiler}: {reason}"
        source, defines = build.level_builds(level)[0]
        with pytest.raises(build.UnsupportedLevel,
                           match=rf"{re.escape(compiler)} \(.*\) cannot build CPU level "
                                 rf"{level.label}: "):
            build.compile_only(source, level, defines, tmp_path / "x.so", compiler=compiler)
        return

    def compile_one(i: int, source: str, defines: dict[str, int]) -> None:
        out = tmp_path / f"{i}.so"
        build.compile_only(source, level, defines, out, compiler=compiler)
        assert out.stat().st_size > 0

    # In parallel: each build is one compiler process, and the suite runs them all.
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for done in [pool.submit(compile_one, i, source, defines)
                     for i, (source, defines) in enumerate(build.level_builds(level))]:
            done.result()


def test_a_compiler_that_fails_runs_level_none_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SPLITSERVE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "echo 'fake-cc: error: broken' >&2; exit 1"))
    with caplog.at_level(logging.WARNING, logger="worker_svc.kernels.build"):
        assert build.usable_level(CpuLevel.AVX512) is CpuLevel.NONE
    assert "do not build at level avx512, running level avx2 instead" in caplog.text
    assert ("do not build at level avx2, running level none (torch for every kernel)"
            in caplog.text)
    assert "fake-cc" in caplog.text and "fake-cc: error: broken" in caplog.text
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_a_compiler_without_avx512_runs_level_avx2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A real compiler that refuses AVX-512 flags, as one too old for a level does.
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("SPLITSERVE_KERNEL_DIR", str(tmp_path / "kernels"))
    compiler = _fake_compiler(tmp_path, f"""for a in "$@"; do case "$a" in -mavx512f)
  echo "fake-cc: error: unrecognized command-line option '-mavx512f'" >&2; exit 1;; esac; done
exec {gcc} "$@" """)
    with caplog.at_level(logging.WARNING, logger="worker_svc.kernels.build"):
        assert build.usable_level(CpuLevel.AMX, compiler) is CpuLevel.AVX2
    for level in ("amx", "avx512_bf16", "avx512"):
        assert f"cannot build CPU level {level}: fake-cc: error: unrecognized" in caplog.text
    assert "running level avx2 instead" in caplog.text
    assert "level avx2, running" not in caplog.text


@pytest.mark.skipif(detect_level() < CpuLevel.AVX2, reason="the test forces level avx2")
def test_a_worker_reports_the_level_its_kernels_build_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The level parsed at start is the one registration and ServerInfo carry (server.py sends
    # config.cpu_level; end to end: tests/e2e/test_cpu_levels.py).
    monkeypatch.setenv("SPLITSERVE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path, "exit 1"))
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    # parse_args caps oneDNN by setdefault; a value here keeps this process's oneDNN uncapped.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL"))
    with caplog.at_level(logging.INFO):
        config = parse_args(["--scheduler", "127.0.0.1:1", "--cpu-level", "avx2",
                             "--device", "cpu"])
    assert config.cpu_level is CpuLevel.NONE
    assert "kernel level none" in caplog.text and "do not build at level avx2" in caplog.text
    caplog.clear()
    monkeypatch.setenv("SPLITSERVE_KERNELS", "torch")        # no C kernels: nothing to check
    assert parse_args(["--scheduler", "127.0.0.1:1", "--cpu-level", "avx2",
                       "--device", "cpu"]).cpu_level is CpuLevel.AVX2
    assert "do not build" not in caplog.text


def test_a_named_compiler_that_is_missing_is_not_replaced(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv("CC", "no-such-cc-9")
    with pytest.raises(RuntimeError, match="'no-such-cc-9'"):
        build.find_compiler()
    assert build.usable_level(CpuLevel.AVX2) is CpuLevel.NONE


def test_the_compiler_is_part_of_the_cache_key(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    compilers = compilers_on_path()[:2]
    if len(compilers) < 2:
        pytest.skip(f"one compiler on PATH ({compilers})")
    monkeypatch.setenv("SPLITSERVE_KERNEL_DIR", str(tmp_path))
    built = {build._cached(c, "elementwise.c", CpuLevel.AVX2, {"ELEM_BF16": 0})
             for c in compilers}
    assert len(built) == 2 and all(path.parent == tmp_path for path in built)
