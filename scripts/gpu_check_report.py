"""What scripts/gpu-check leaves in its output folder, made from its work folder:

    python scripts/gpu_check_report.py summary WORK OUT   # OUT/summary.txt, one screen
    python scripts/gpu_check_report.py junit WORK OUT     # OUT/junit.xml, every phase's tests
    python scripts/gpu_check_report.py logs WORK OUT      # OUT/cluster-logs.tar.gz

WORK/phases.tsv has one line per phase, written by gpu-check as it goes:
`name<TAB>status<TAB>seconds<TAB>limit<TAB>what it checks`; WORK/<name>.out is that phase's
output and WORK/<name>.xml its pytest junit file. Every file made here stays under the device
tool's limits (16 MiB a file): a cluster log is cut to its last MAX_LOG_BYTES.
"""

import io
import json
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

MAX_LOG_BYTES = 1 << 20          # the end of each service log is what tells
MAX_TARBALL_BYTES = 15 << 20     # under the 16 MiB a returned file may have
SUMMARY_LINES = 40


def read_phases(work: Path) -> list[list[str]]:
    path = work / "phases.tsv"
    if not path.is_file():
        return []
    return [line.split("\t") for line in path.read_text().splitlines() if line.strip()]


def phase_detail(work: Path, name: str) -> str:
    """The line that says most about a phase: pytest's result line, the bench's figures, or
    the phase's last line."""
    out = work / f"{name}.out"
    lines = out.read_text(errors="replace").splitlines() if out.is_file() else []
    for line in reversed(lines):
        if " passed" in line or " failed" in line or " error" in line or "no tests ran" in line:
            return line.strip("= ").strip()
    for line in reversed(lines):
        if line.startswith("gpu-check:"):
            return line.removeprefix("gpu-check:").strip()
    return lines[-1].strip() if lines else ""


def bench_lines(out: Path) -> list[str]:
    """A line per shape and system from each OUT/bench*.json (bench/gpu_throughput.py's
    results: bench.json, and the named runs beside it, e.g. bench-kv-fp8.json), labelled
    with the file's name where it is not bench.json."""
    lines = []
    for path in sorted(out.glob("bench*.json")):
        label = "" if path.stem == "bench" else f"{path.stem}: "
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            lines.append(f"{path.name} unreadable: {exc}")
            continue
        if result.get("dry_run"):
            lines.append(f"{label}bench: dry run (arguments parsed, nothing measured)")
            continue
        for shape, systems in (result.get("shapes") or {}).items():
            for system, figures in (systems.items() if isinstance(systems, dict) else []):
                if isinstance(figures, dict):
                    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in figures.items()
                                      if isinstance(v, (int, float)))[:150]
                    lines.append(f"{label}{shape} / {system}: {shown}")
    return lines


def summary(work: Path, out: Path) -> str:
    phases = read_phases(work)
    header = (work / "header.txt").read_text().strip() if (work / "header.txt").is_file() \
        else ""
    rows = [header, f"{'phase':<16} {'status':<8} {'s':>5} {'limit':>5}  detail"]
    for name, status, seconds, limit, *_ in phases:
        rows.append(f"{name:<16} {status:<8} {seconds:>5} {limit:>5}  "
                    f"{phase_detail(work, name)[:120]}")
    rows += bench_lines(out)
    failed = [p[0] for p in phases if p[1] not in ("PASS", "DRY")]
    rows.append("result: " + ("every phase passed" if not failed
                              else f"not passed: {', '.join(failed)}"))
    text = "\n".join(r for r in rows if r)
    lines = text.splitlines()
    if len(lines) > SUMMARY_LINES:
        lines = lines[:SUMMARY_LINES - 1] + [f"... ({len(lines) - SUMMARY_LINES + 1} more)"]
    return "\n".join(lines) + "\n"


def merge_junit(work: Path) -> bytes:
    """One <testsuites> holding every phase's suites, each suite named after its phase."""
    merged = ET.Element("testsuites")
    for name, *_ in read_phases(work):
        path = work / f"{name}.xml"
        if not path.is_file():
            continue
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError:
            continue
        suites = [root] if root.tag == "testsuite" else list(root)
        for suite in suites:
            suite.set("name", f"{name}:{suite.get('name', 'pytest')}")
            merged.append(suite)
    return ET.tostring(merged, encoding="utf-8", xml_declaration=True)


def logs_tarball(work: Path) -> bytes:
    """Every service log under WORK (the clusters' log folders), each cut to its end,
    newest first until the tarball would pass MAX_TARBALL_BYTES."""
    logs = sorted((p for p in work.rglob("*.log") if p.is_file()),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in logs:
            data = path.read_bytes()[-MAX_LOG_BYTES:]
            info = tarfile.TarInfo(str(path.relative_to(work)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            if buffer.tell() > MAX_TARBALL_BYTES - MAX_LOG_BYTES:
                break
    return buffer.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("summary", "junit", "logs"):
        print(__doc__, file=sys.stderr)
        return 2
    what, work, out = argv[0], Path(argv[1]), Path(argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if what == "summary":
        (out / "summary.txt").write_text(summary(work, out))
    elif what == "junit":
        (out / "junit.xml").write_bytes(merge_junit(work))
    else:
        (out / "cluster-logs.tar.gz").write_bytes(logs_tarball(work))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
