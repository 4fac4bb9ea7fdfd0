"""The side environment bench/peers.py runs torchtitan in: `.peers-venv/` at the repository root,
torchtitan pinned, sharing the calling interpreter's torch.

    python bench/peers_env.py [--wheels DIR]     prints the side environment's python
    python bench/peers_env.py --download DIR     fills DIR with the wheels an offline machine needs

Why it shares torch: the comparison must run both frameworks on the same torch build, and a
fresh `pip install torchtitan` would download a second torch (a CUDA one from PyPI, gigabytes).
So the venv gets a .pth file naming the caller's site-packages (torch and everything else
installed there is found), pip is told `torch==<the running version>` as a constraint, and
only what is missing or conflicting (torchtitan's pins, e.g. datasets<4.8) goes into the side
venv, whose own site-packages come first on its path. The check after the install refuses an
environment whose torch is not the caller's. Standard library only: it runs before torchtitan
exists anywhere.

Measured on the 2-core CPU machine (torch 2.13, Python 3.11, pip's cache warm): 12.7 s to make it
(13 packages installed, torch untouched), 8.1 s offline from --wheels, 0.3 s when it is there
already; a fresh venv with `pip install torch==2.13.0 torchtitan==0.3.0` took 86 s. The wheels
--download fetches weigh 3.7 MB, all pure Python (datasets, dill, docstring_parser, einops,
fsspec, huggingface_hub, multiprocess, spmd_types, torch_checkpointing, torchdata, torchtitan,
typeguard, tyro); the offline machine must have torchtitan's other requirements already.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import site
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

TORCHTITAN = "torchtitan==0.3.0"
REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".peers-venv"
MARKER = "forja-peers.json"  # what the environment was made with; a different caller remakes it
LINK = "forja-peers-caller.pth"


def _caller_paths() -> list[str]:
    """The calling interpreter's site-packages folders (its venv's, the system's, the user's), in
    its search order: where its torch is found. PYTHONPATH needs no link: the children inherit it."""
    sites = set(site.getsitepackages()) | {site.getusersitepackages()}
    named = ("site-packages", "dist-packages")
    return [p for p in sys.path if os.path.isdir(p) and (p in sites or Path(p).name in named)]


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip())


def _torch_version() -> str:
    """The caller's torch version, read from its metadata (importing torch takes seconds)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise RuntimeError(f"the calling interpreter {sys.executable} has no torch") from None


def _probe(python: Path) -> dict | None:
    """What the side environment sees, from metadata: torch's version and place, torchtitan's
    version; None when it cannot say."""
    code = ("import json, importlib.metadata as m; t = m.distribution('torch'); "
            "print(json.dumps({'torch': t.version, 'torch_at': str(t.locate_file('')), "
            "'torchtitan': m.version('torchtitan')}))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


def _check(python: Path, torch_version: str, side: Path) -> str:
    """Refuse a side environment whose torch is not the caller's (reinstalled or shadowed):
    import it there and say where it came from."""
    code = "import torch, torchtitan; print(torch.__version__, torch.__file__, torchtitan.__version__)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{python} cannot import torch and torchtitan:\n{done.stderr[-1500:]}")
    version, where, titan = done.stdout.split()[-3:]
    if version != torch_version or Path(where).resolve().is_relative_to(side.resolve()):
        raise RuntimeError(f"the side environment's torch is {version} at {where}, not the caller's "
                           f"{torch_version}: pip installed a second torch there")
    if titan != TORCHTITAN.split("==")[1]:
        raise RuntimeError(f"{side} holds torchtitan {titan}, not {TORCHTITAN}")
    return f"torch {version} ({where})"


def _pip(python: Path, wheels: str | None, torch_version: str) -> None:
    """Install TORCHTITAN into the side venv, torch held at the caller's version."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={torch_version}\n")
        constraint = f.name
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-warn-conflicts", "-c", constraint, TORCHTITAN]
    if wheels:
        cmd[4:4] = ["--no-index", "--find-links", str(Path(wheels).resolve())]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(constraint)
    if done.returncode:
        raise RuntimeError(f"pip could not install {TORCHTITAN} into {python.parents[1]}:\n{done.stderr[-2000:]}")


def ensure_env(wheels: str | None = None, venv: Path = VENV, log=sys.stderr) -> Path:
    """The side environment's python, made or remade only when it is missing, broken, or made
    for another caller (another torch or another set of package folders). One process makes it
    at a time (a lock file beside it): test workers running two harnesses may ask at once."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _ensure_env(wheels, venv, log)


def _ensure_env(wheels: str | None, venv: Path, log) -> Path:
    torch_version, paths = _torch_version(), _caller_paths()
    want = {"torchtitan": TORCHTITAN, "torch": torch_version, "caller": sys.executable, "paths": paths}
    python, marker = _python(venv), venv / MARKER
    if marker.exists() and json.loads(marker.read_text()) == want and _probe(python) is not None:
        return python  # made before for this caller: a metadata look, no import of torch
    started = time.perf_counter()
    if not python.exists():
        # No pip of its own: the caller's pip is found through the .pth, like torch.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (_site_packages(python) / LINK).write_text("".join(p + "\n" for p in paths))
    _pip(python, wheels, torch_version)
    seen = _check(python, torch_version, venv)
    marker.write_text(json.dumps(want, indent=1))
    print(f"peers_env: {TORCHTITAN} in {venv} over {seen}, {time.perf_counter() - started:.1f} s", file=log)
    return python


def installed_here(venv: Path = VENV) -> list[str]:
    """`name==version` of every package pip put into the side venv: what torchtitan needs beyond
    the caller's packages (measured here: torchtitan, spmd_types, torch_checkpointing, tyro and
    its docstring-parser and typeguard, torchdata, einops, and datasets 4.7 with the fsspec,
    dill, multiprocess and huggingface_hub versions it pins)."""
    code = ("import sys, importlib.metadata as m; "
            "print('\\n'.join(sorted({f'{d.name}=={d.version}' for d in m.distributions(path=[sys.argv[1]])})))")
    site_dir = _site_packages(_python(venv))
    done = subprocess.run([str(_python(venv)), "-c", code, str(site_dir)], check=True, capture_output=True, text=True)
    return done.stdout.split()


def download(folder: str, venv: Path = VENV) -> list[str]:
    """The wheels of installed_here(), for the GPU machine's Python 3.12 on x86-64 Linux and
    without their requirements (above all without torch), into `folder`: what a machine that
    has forja's environment but no registry lacks (run after ensure_env here)."""
    wanted = installed_here(venv)
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp",
           *[arg for p in platforms for arg in ("--platform", p)], "-d", folder, *wanted]
    subprocess.run(cmd, check=True)
    return wanted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", default=None, help="install offline from this folder of wheels")
    p.add_argument("--download", default=None, metavar="DIR", help="download the offline wheels into DIR and stop")
    args = p.parse_args()
    if args.download:
        ensure_env(wheels=args.wheels)
        print("\n".join(download(args.download)))
        return
    print(ensure_env(wheels=args.wheels))


if __name__ == "__main__":
    main()
