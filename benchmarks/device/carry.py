"""Run ``benchmarks/gpu_suite.py`` on a borrowed GPU machine that has torch, Triton, Lightning and transformers but
no index to install the rest from, and that returns only a few files of bounded size.

    python benchmarks/device/carry.py fetch .whl                            # here, with an index: ~5 MiB of wheels
    python3 benchmarks/device/carry.py run --wheels .whl --out $OUT         # there: install, then the suite

``fetch`` downloads the third-party wheels such a machine lacks (:data:`THIRD_PARTY`), pinned to the versions
installed here, for CPython 3.12 on manylinux x86_64, and builds mixerzoo's and every plugin's wheel into the
folder. ``run`` installs the carried wheels (``pip install --no-index --no-deps --target SITE``: mixerzoo's and its
plugins' always, a third-party wheel only where its distribution is not installed already; the log in
``install.txt``), runs the suite with SITE on ``PYTHONPATH`` after the checkout (the checkout's code is what runs;
the wheels give the entry points and what the machine lacked), then cuts every file under ``--out`` to
:data:`MAX_BYTES` (head and tail kept) and refuses more than :data:`MAX_FILES` of them. Arguments after ``--`` go
to the suite (``-- --dry-run``, ``-- --only efficiency``).
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
MAX_FILES, MAX_BYTES = 8, 16 * 2**20  # what one command of the device machine returns
# What a GPU machine with torch, Triton, Lightning, torchmetrics and transformers lacks: the fla
# kernels, jsonargparse with its signature extras (the CLI), datasets and the two of its requirements that are
# not common (the rest, pyarrow, xxhash, fsspec, pandas, huggingface_hub, ..., come with transformers or are there).
THIRD_PARTY = ["flash-linear-attention", "fla-core", "jsonargparse", "typeshed-client", "docstring-parser",
               "datasets", "dill", "multiprocess"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
MAX_WHEELS_MIB = 48  # the device machine takes 64 MiB in all with the checkout


def dist_name(wheel: str) -> str:
    """A wheel file's distribution, normalised (PEP 503): ``fla_core-0.6.0-py3-none-any.whl`` -> ``fla-core``."""
    return re.sub(r"[-_.]+", "-", os.path.basename(wheel).split("-")[0]).lower()


def ours(dist: str) -> bool:
    return dist == "mixerzoo" or dist.startswith("mixerzoo-")


def plugin_dirs() -> list[Path]:
    return sorted(p for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file())


def carried_wheels(folder: str) -> tuple[list[str], list[str]]:
    """The wheels of ``folder`` to install (mixerzoo's and its plugins' always, a third-party one only where its
    distribution is not installed here) and a line for each one left out."""
    install, skipped = [], []
    for wheel in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        dist = dist_name(wheel)
        try:
            have = None if ours(dist) else importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have is None:
            install.append(wheel)
        else:
            skipped.append(f"{os.path.basename(wheel)}: {dist} {have} is installed already")
    return install, skipped


def install(folder: str, site: str, log: Path) -> int:
    """Install :func:`carried_wheels` of ``folder`` into ``site``; the command, what was left out and pip's output
    go to ``log``. Returns pip's exit code."""
    wheels, skipped = carried_wheels(folder)
    with open(log, "w") as f:
        f.write("".join(f"# left out: {s}\n" for s in skipped))
        if not wheels:
            f.write("no wheel to install\n")
            return 0
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
               "--target", site, *wheels]
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        got = sorted(d[:-len(".dist-info")] for d in os.listdir(site) if d.endswith(".dist-info")) \
            if os.path.isdir(site) else []
        f.write(f"installed from the carried wheels into {site}: {', '.join(got)}\n")
    return rc


def cap_file(path: Path, limit: int = MAX_BYTES) -> None:
    """Cut a file over ``limit`` bytes to its first and last halves of it, with a line saying so."""
    size = path.stat().st_size
    if size <= limit:
        return
    half = limit // 2 - 200
    with open(path, "rb") as f:
        head = f.read(half)
        f.seek(size - half)
        tail = f.read()
    path.write_bytes(head + f"\n[carry] ... {size - 2 * half} bytes cut here (file over {limit} bytes) ...\n"
                     .encode() + tail)


def fetch_wheels(dest: str, python_version: str = "3.12") -> int:
    """Download :data:`THIRD_PARTY`'s wheels pinned to the versions installed here (``pip download --no-deps
    --only-binary=:all:`` for CPython ``python_version`` on manylinux x86_64) and build mixerzoo's and every
    plugin's wheel (``pip wheel --no-deps``, from a copy of its sources) into ``dest``; older wheels of the same
    distributions there are removed. Refuses a folder over :data:`MAX_WHEELS_MIB`."""
    folder = Path(dest).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    pins = {name: importlib.metadata.version(name) for name in THIRD_PARTY}
    names = set(pins) | {"mixerzoo"} | {dist_name(p.name) for p in plugin_dirs()}
    for old in folder.glob("*.whl"):
        if dist_name(old.name) in names:
            old.unlink()
    pip = [sys.executable, "-m", "pip"]
    cmd = pip + ["download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
                 "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(folder),
                 *[f"{n}=={v}" for n, v in pins.items()]]
    print("$", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        for project in [ROOT, *plugin_dirs()]:
            copy = Path(tmp) / project.name
            copy.mkdir()
            for item in ("pyproject.toml", "README.md", "LICENSE", "mixerzoo", "src"):
                src = project / item
                if src.is_dir():
                    shutil.copytree(src, copy / item, ignore=shutil.ignore_patterns(
                        "__pycache__", "*.egg-info", "*.pyc"))
                elif src.is_file():
                    shutil.copy2(src, copy / item)
            cmd = pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder), str(copy)]
            print("$", shlex.join(cmd), flush=True)
            subprocess.run(cmd, check=True)
    wheels = sorted(folder.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{total / 2**20:7.2f} MiB  in all, {len(wheels)} wheels in {folder}")
    if total > MAX_WHEELS_MIB * 2**20:
        print(f"carry: {folder} is over {MAX_WHEELS_MIB} MiB; the device machine takes 64 MiB in all",
              file=sys.stderr)
        return 1
    return 0


def run(wheels: str, out: str, site: str, suite_args: list[str]) -> int:
    """Install the carried wheels, run the suite into ``out`` with ``site`` on ``PYTHONPATH``, bound its files.
    Returns the suite's exit code (2 when pip failed or the suite wrote more than :data:`MAX_FILES` files)."""
    folder = Path(out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if install(wheels, site, folder / "install.txt"):
        print(f"carry: installing the wheels of {wheels} failed; see {folder / 'install.txt'}", file=sys.stderr)
        return 2
    path = os.pathsep.join([site] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    rc = subprocess.run([sys.executable, str(SUITE), "--out", str(folder), *suite_args], cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": path}).returncode
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for f in files:
        cap_file(f)
    if len(files) > MAX_FILES:
        print(f"carry: {len(files)} files under {folder}, more than the {MAX_FILES} the device machine returns",
              file=sys.stderr)
        return 2
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    suite_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    fetch = sub.add_parser("fetch", help="download the third-party wheels and build ours into DIR (here)")
    fetch.add_argument("dir")
    go = sub.add_parser("run", help="install the carried wheels, then run gpu_suite.py (on the GPU machine)")
    go.add_argument("--wheels", required=True, help="the folder `fetch` filled")
    go.add_argument("--out", required=True, help="the suite's --out")
    go.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "carried_site"),
                    help="where the wheels go (pip --target)")
    args = p.parse_args(argv)
    if args.what == "fetch":
        return fetch_wheels(args.dir)
    if not os.path.isdir(args.wheels):
        p.error(f"--wheels {args.wheels}: no such folder (make it with `carry.py fetch {args.wheels}`)")
    return run(args.wheels, args.out, args.site, suite_args)


if __name__ == "__main__":
    sys.exit(main())
