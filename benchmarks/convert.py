"""Wall time and peak memory of `needle-hf convert` on a Needle 2 (`base` preset) native checkpoint.

Targets (issue 3): wall time <= 10 s and peak RSS <= 3x the checkpoint size.

Each variant runs the real command line in a fresh child process (`python -m needle_hf.cli`), so
the figures include the interpreter start and every import, as a user sees them. The child's own
peak RSS comes from `os.wait4` (the kernel's ru_maxrss for that process alone). The conversion's
own time, without the imports, is the "s" the summary line prints; it is reported beside the wall
time. An "imports only" run measures the floor every variant pays.

Usage: python benchmarks/convert.py [--variants default 'logits: flax'] [--workdir DIR] [--show-steps]
Needs the test dependencies (the reference builds the checkpoint's parameter tree).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TARGET_SECONDS = 10.0
TARGET_RSS_RATIO = 3.0
VARIANTS = {
    "imports only": None,
    "default": [],
    "logits: flax": ["--verify-with", "flax"],
    "logits: torch": ["--verify-with", "torch"],
}
_SUMMARY_SECONDS = re.compile(r"bytes \([a-z0-9]+\), ([0-9.]+) s")


def build_checkpoint(folder: Path) -> Path:
    """A base-preset native checkpoint with every leaf perturbed, written the reference's way.

    Built in a child process: a measured child inherits its parent's resident size at fork as its
    starting peak RSS (ru_maxrss counts the pages it shares before exec), so this process must stay
    small and never hold the checkpoint itself.
    """
    path = folder / "needle2-base.pkl"
    script = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from needle_reference import BASE_NATIVE_CONFIG, make_native_params, write_native_checkpoint\n"
        "write_native_checkpoint(sys.argv[1], make_native_params(BASE_NATIVE_CONFIG, seed=0), BASE_NATIVE_CONFIG)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path), str(REPO / "tests")], check=True, cwd=REPO)
    return path


def run_child(command: list[str]) -> tuple[float, int, str, str, int]:
    """(wall seconds, peak RSS bytes, stdout, stderr, exit status) of one child process."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        return wall, usage.ru_maxrss * 1024, out.read().decode(), err.read().decode(), child.returncode


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--workdir", type=Path, help="where to write the checkpoint and outputs (default: a temp dir)")
    parser.add_argument("--show-steps", action="store_true", help="print each run's timed progress lines")
    args = parser.parse_args(argv)
    print(f"benchmark process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB peak RSS "
          "(each child starts from its parent's size; this must stay small)")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="needle-convert-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"building the base-preset checkpoint in {workdir} ...", flush=True)
    checkpoint = build_checkpoint(workdir)
    size = checkpoint.stat().st_size
    print(f"checkpoint: {size / 1e6:.1f} MB; targets: <= {TARGET_SECONDS:.0f} s, peak RSS <= {TARGET_RSS_RATIO:.0f}x "
          f"= {TARGET_RSS_RATIO * size / 1e6:.0f} MB\n", flush=True)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(other processes slow every figure down)\n")
    print(f"{'variant':<14}{'wall s':>8}{'/target':>9}{'convert s':>11}{'peak RSS MB':>13}{'/ckpt':>7}")
    for name in args.variants:
        extra = VARIANTS[name]
        if extra is None:
            command = [sys.executable, "-c", "import needle_hf.cli, needle_hf.conversion.convert"]
        else:
            out_dir = workdir / f"out-{name}"
            command = [sys.executable, "-m", "needle_hf.cli", "convert", str(checkpoint), str(out_dir), "--overwrite", *extra]
        wall, rss, stdout, stderr, status = run_child(command)
        if status != 0:
            print(f"{name}: exit status {status}\n{stderr}", file=sys.stderr)
            continue
        match = _SUMMARY_SECONDS.search(stdout)
        converting = f"{float(match.group(1)):.1f}" if match else "-"
        print(f"{name:<14}{wall:>8.1f}{wall / TARGET_SECONDS:>9.2f}{converting:>11}{rss / 1e6:>13.0f}{rss / size:>7.2f}",
              flush=True)
        if args.show_steps:
            for line in stderr.splitlines():
                if line.startswith("needle-hf convert ["):
                    print(f"    {line}")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\nwall = the whole process (interpreter, imports, conversion); convert s = the conversion itself "
          "(the summary line); '/target' and '/ckpt' are the ratios to the issue's targets (<= 1.00 and <= 3.00).")


if __name__ == "__main__":
    main()
