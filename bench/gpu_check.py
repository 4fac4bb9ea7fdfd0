"""`make gpu-check`: the GPU tests, then the GPU benchmark at a size that fits, as one command
that ends within 9 minutes on one H200 (one device call) and prints one table ready for
bench/RESULTS.md.

    python bench/gpu_check.py       # from the repository root, the repository on PYTHONPATH

1. Wheels carried in `.whl/` (scripts/gpu_wheels.sh: torchao, liger-kernel, fla-core) are installed
   into /tmp/site with pip, offline, for a machine that reaches no package registry.
2. `pytest tests/gpu` in a child process, stopped after TESTS_TIMEOUT_S; its outcomes are read
   from a JUnit report. A skipped test has not passed: only one that needs more GPUs than the
   machine has (its skip reason says "needs N CUDA GPUs") is listed apart without failing.
3. `bench/peers.py --size 1b`: forja against torchtitan 0.3.0 (wheels carried in .whl/peers,
   made by scripts/gpu_wheels.sh, installed offline into its side environment) on Llama 3.2-1B,
   4,096 tokens, bf16, eager and each one's recommended settings; stopped after PEERS_S.
4. With the time left, `bench/gpu.py --size check` and `bench/moe.py --gpu`; each skips what
   would start too late, and is stopped if it still runs at the end.
5. One markdown table (date, GPU, versions and git revision above it), also written to
   $OUT/gpu_check.md when OUT is set, beside the logs of steps 2 and 3.

GPU_CHECK_BUDGET_S changes the 530 s budget (the benchmark gets what the tests leave of it);
FORJA_GIT_REV names the revision where the copy has no git checkout. Without a CUDA GPU it
says so in one line and exits 3 (asked to check a GPU, it checked none). It exits 1 when a
test failed, errored or was skipped (other than for want of GPUs), or when the tests or the
benchmark did not finish.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")  # where carried wheels are installed (outside the repository)
# Under 9 minutes, everything included: a device call may last 10, and the machine's start and
# the return of $OUT count against the same session's device time.
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", 530))
TESTS_TIMEOUT_S = 240  # 55 tests; the slowest are compilations (FlexAttention, Triton) and fp16's 3 runs
TEST_TIMEOUT_S = 150  # one test (pytest-timeout): a hung NCCL group fails alone
WHEELS_S = 15  # pip's offline install of .whl/
IN_FLIGHT_S = 100  # the longest single benchmark item: a compiled training variant with its compilation
MIN_BENCH_S = IN_FLIGHT_S + 30  # below this bench/gpu.py is not started
PEERS_S = 200  # bench/peers.py at 1b: four contenders, two of them compiled, 3 rounds of 5 steps
PEERS = ("forja eager,forja recommended (compile + fused ops),torchtitan eager,"
         "torchtitan recommended (compile)")
MARGIN_S = 20  # starting the children, writing the table
EXIT_NO_GPU = 3
NEEDS_GPUS = re.compile(r"needs (\d+) (?:CUDA )?GPUs?\b")  # the skip reason of a test that needs more
BENCH_SIZE = "check"  # bench/gpu.py's size made to fit: Llama 3.2-1B, few steps
PLAN = f"tests/gpu, then bench/peers.py --size 1b, then bench/gpu.py --size {BENCH_SIZE} and bench/moe.py --gpu"
MOE_S = 90  # bench/moe.py --gpu's training and grouped-GEMM sections at 30b-a3b shapes


def limits_fit(budget_s: float = BUDGET_S) -> bool:
    """Whether the stages that must run (the tests, the peers) fit the budget, so that neither is
    cut short by the device call; bench/gpu.py and bench/moe.py take what is left."""
    return WHEELS_S + TESTS_TIMEOUT_S + PEERS_S + MARGIN_S <= budget_s <= 540 \
        and TEST_TIMEOUT_S < TESTS_TIMEOUT_S


def no_gpu() -> str | None:
    """Why there is nothing to check here, or None when a CUDA GPU is present."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed here, so there is no GPU to check"
    if not torch.cuda.is_available():
        return f"no CUDA GPU here (torch {torch.__version__} sees none)"
    return None


def install_wheels(env: dict) -> str:
    """Install the wheels of `.whl/` into SITE and put SITE first on the import paths."""
    wheels = sorted(str(p) for p in (REPO / ".whl").glob("*.whl"))
    if not wheels:
        return "none (no .whl/ folder; scripts/gpu_wheels.sh makes it)"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        said = (done.stderr.strip().splitlines() or ["nothing"])[-1]
        return f"NOT installed (pip: {said}); variants that need them are skipped"
    sys.path.insert(0, str(SITE))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    names = [Path(w).name.split("-")[:2] for w in wheels]
    return ", ".join(f"{name} {version}" for name, version in names)


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict) -> tuple[int | None, float]:
    """(exit status, or None when stopped at `timeout`; seconds); output goes to `log`."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and whatever it started (compile workers)
            proc.wait()
            rc = None
    return rc, time.monotonic() - start


def row(section: str, what: str, figure: str = "", vs: str = "", note: str = "") -> dict:
    return dict(section=section, what=what, figure=figure, vs=vs, note=note)


def read_junit(xml_text: str, gpus: int) -> dict:
    """Outcomes of a pytest JUnit report: passed (a count), failed (test ids: failures and
    errors, collection errors included), skipped ((test id, reason): not passed) and
    need_gpus ((test id, N): skipped because it needs N > `gpus` GPUs, not counted against)."""
    out = {"passed": 0, "failed": [], "skipped": [], "need_gpus": []}
    for case in ET.fromstring(xml_text).iter("testcase"):
        node = "::".join(filter(None, [case.get("classname"), case.get("name")]))
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(node)
        elif (skip := case.find("skipped")) is not None:
            reason = skip.get("message", "").removeprefix("Skipped: ")
            needs = NEEDS_GPUS.search(reason)
            if needs and int(needs.group(1)) > gpus:
                out["need_gpus"].append((node, int(needs.group(1))))
            else:
                out["skipped"].append((node, reason))
        else:
            out["passed"] += 1
    return out


def rows_of_tests(outcomes: dict | None, seconds: float, note: str) -> list[dict]:
    """The table's rows for the GPU tests: the counts, then each test that did not pass."""
    if outcomes is None:
        return [row("tests", "pytest tests/gpu", f"no report in {seconds:.0f} s", note=note or "see pytest.log")]
    o = outcomes
    figure = (f"{o['passed']} passed, {len(o['failed'])} failed, {len(o['skipped'])} skipped (not passed), "
              f"{len(o['need_gpus'])} need more GPUs, in {seconds:.0f} s")
    rows = [row("tests", "pytest tests/gpu", figure, note=note)]
    rows += [row("tests", node, "failed", note="see pytest.log") for node in o["failed"]]
    rows += [row("tests", node, "skipped", note=f"not passed: {reason}") for node, reason in o["skipped"]]
    rows += [row("tests", node, f"needs {n} GPUs", note="not run on this machine") for node, n in o["need_gpus"]]
    return rows


def verdict(outcomes: dict | None) -> list[str]:
    """The lines printed after the table: which tests were skipped (not passed), which need more GPUs."""
    if not outcomes:
        return []
    lines = []
    if outcomes["skipped"]:
        lines.append(f"gpu-check: {len(outcomes['skipped'])} GPU tests skipped, not passed: "
                     + ", ".join(node for node, _ in outcomes["skipped"]))
    if outcomes["need_gpus"]:
        lines.append(f"gpu-check: {len(outcomes['need_gpus'])} GPU tests need more GPUs (not failed): "
                     + ", ".join(f"{node} (needs {n} GPUs)" for node, n in outcomes["need_gpus"]))
    return lines


def run_tests(env: dict, out_dir: Path, gpus: int) -> tuple[list[dict], bool, list[str]]:
    """Rows of the GPU tests, whether they fall short (a test failed or was skipped other than
    for want of GPUs, or pytest did not finish) and the verdict's lines."""
    log, report = out_dir / "pytest.log", out_dir / "pytest.xml"
    report.unlink(missing_ok=True)
    # A module that fails to import is one error in the report, not the end of the others' run.
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu",
           "--continue-on-collection-errors", "-o", f"timeout={TEST_TIMEOUT_S}", f"--junitxml={report}"]
    print(f"gpu-check: pytest tests/gpu (log: {log})", flush=True)
    rc, seconds = run_logged(cmd, log, TESTS_TIMEOUT_S, env)
    note = "" if rc == 0 else (f"stopped at the {TESTS_TIMEOUT_S} s limit" if rc is None else f"exit status {rc}")
    outcomes = read_junit(report.read_text(), gpus) if report.exists() else None
    short = rc != 0 or outcomes is None or bool(outcomes["failed"] or outcomes["skipped"])
    return rows_of_tests(outcomes, seconds, note), short, verdict(outcomes)


def run_bench(env: dict, out_dir: Path, seconds_left: float) -> tuple[list[dict], bool]:
    """Rows of bench/gpu.py at BENCH_SIZE, read back as it wrote them, and whether it failed."""
    jsonl, log = out_dir / "bench.jsonl", out_dir / "bench.log"
    budget = seconds_left - IN_FLIGHT_S
    if seconds_left < MIN_BENCH_S:
        skipped = row("bench", f"bench/gpu.py --size {BENCH_SIZE}", note=f"skipped: only {seconds_left:.0f} s left")
        return [skipped], False  # an extra after the peers: the table says it did not run
    jsonl.unlink(missing_ok=True)
    cmd = [sys.executable, "bench/gpu.py", "--size", BENCH_SIZE, "--budget-s", f"{budget:.0f}", "--jsonl", str(jsonl)]
    print(f"gpu-check: {' '.join(cmd[1:])} (log: {log})", flush=True)
    rc, seconds = run_logged(cmd, log, seconds_left, env)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    if rc is None:
        rows.append(row("bench", f"bench/gpu.py --size {BENCH_SIZE}",
                        note=f"stopped at the {seconds_left:.0f} s limit; rows after this were not measured"))
    elif rc != 0:  # a crash: its last line (the exception, usually) says why
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["(empty)"]
        rows.append(row("bench", f"bench/gpu.py --size {BENCH_SIZE}", note=f"failed: exit status {rc}, rows "
                        f"after this were not measured; bench.log ends: {last[0][:160]}"))
    return rows, rc != 0


def revision() -> str:
    """The git revision of the checkout, or FORJA_GIT_REV where there is no git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FORJA_GIT_REV") or "unknown (no git checkout here; set FORJA_GIT_REV)"


def header(carried: str, seconds: float) -> str:
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = "not installed"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        "## `make gpu-check` (bench/gpu_check.py)", "",
        f"- **Date:** {now}",
        f"- **Machine:** {props.name} ({props.total_memory / 2**30:.0f} GiB), {os.cpu_count()} CPU cores; "
        f"Python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton}",
        f"- **Carried wheels:** {carried}",
        f"- **Revision:** {revision()}",
        f"- **Command:** `make gpu-check` ({PLAN}); {seconds:.0f} s in all, within a {BUDGET_S:.0f} s budget", ""])


def table(rows: list[dict]) -> str:
    """bench/gpu.py's table, written again here: the check must report even when gpu.py fails to import."""
    def cell(r: dict, key: str) -> str:
        text = r[key] or ("—" if key in ("figure", "vs") else "")
        return text.replace("|", "\\|")  # a pipe inside a cell would split it

    lines = ["| section | what | figure | vs baseline | note |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell(r, k) for k in ("section", "what", "figure", "vs", "note")) + " |" for r in rows]
    return "\n".join(lines)


def run_peers(env: dict, out_dir: Path) -> tuple[list[dict], bool]:
    """bench/peers.py at 1b against torchtitan: a row per pair (forja / peer), tables in peers.md."""
    peers = out_dir / "peers"
    wheels = REPO / ".whl" / "peers"
    cmd = [sys.executable, "bench/peers.py", "--size", "1b", "--rounds", "3", "--steps", "5", "--warmup", "3",
           "--only", PEERS, "--out", str(peers), *(["--wheels", str(wheels)] if wheels.is_dir() else [])]
    log = out_dir / "peers.log"
    print(f"gpu-check: {' '.join(cmd[1:])} (log: {log})", flush=True)
    rc, seconds = run_logged(cmd, log, PEERS_S, env)
    result = peers / "peers.json"
    if rc != 0 or not result.exists():
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["(empty)"]
        why = f"stopped at the {PEERS_S} s limit" if rc is None else f"failed: exit status {rc}"
        return [row("peers", "bench/peers.py --size 1b", note=f"{why}; peers.log ends: {last[0][:160]}")], True
    pairs = json.loads(result.read_text())["pairs"]
    return [row("peers", f"{p['forja']} / {p['peer']}", f"{p['ratio']:.2f}x", note="tokens/s; peers/peers.md")
            for p in pairs], False


def run_moe_bench(env: dict, out_dir: Path, seconds_left: float) -> tuple[list[dict], bool]:
    """bench/moe.py --gpu (its tables go to moe.md); a row saying where, or why not."""
    what = "bench/moe.py --gpu --sections train grouped_mm"
    if seconds_left < MOE_S:
        return [row("bench", what, note=f"skipped: only {seconds_left:.0f} s left")], False
    md, log = out_dir / "moe.md", out_dir / "moe.log"
    cmd = [sys.executable, "bench/moe.py", "--gpu", "--sections", "train", "grouped_mm",
           "--json", str(out_dir / "moe.json")]
    print(f"gpu-check: {' '.join(cmd[1:])} (log: {log})", flush=True)
    rc, seconds = run_logged(cmd, log, seconds_left, env)
    md.write_text(log.read_text(errors="replace"))
    note = "tables in moe.md" if rc == 0 else ("stopped at the time limit" if rc is None else f"failed: exit {rc}")
    return [row("bench", what, f"{seconds:.0f} s", note=note)], rc != 0


def main() -> int:
    start = time.monotonic()
    why = no_gpu()
    if why:
        print(f"gpu-check: {why}; nothing run, nothing checked (on a GPU it runs {PLAN}, and prints one table).")
        return EXIT_NO_GPU
    import torch
    if not limits_fit():
        print(f"gpu-check: a {BUDGET_S:.0f} s budget does not fit every stage's limit (or exceeds 540 s): "
              "stages at the end will be skipped or cut short", flush=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "runs" / "gpu-check"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # One compile cache for the tests and the benchmark: the tests' FlexAttention kernels serve both.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / "runs" / ".inductor-cache"))
    carried = install_wheels(env)
    test_rows, tests_short, test_verdict = run_tests(env, out_dir, torch.cuda.device_count())
    peer_rows, peers_failed = run_peers(env, out_dir)
    left = BUDGET_S - (time.monotonic() - start) - MARGIN_S
    bench_rows, bench_failed = run_bench(env, out_dir, left - MOE_S)
    left = BUDGET_S - (time.monotonic() - start) - MARGIN_S
    moe_rows, moe_failed = run_moe_bench(env, out_dir, left)
    rows = test_rows + peer_rows + bench_rows + moe_rows
    report = header(carried, time.monotonic() - start) + "\n" + table(rows) + "\n"
    (out_dir / "gpu_check.md").write_text(report)
    print("\n" + report + "\n".join(test_verdict), flush=True)  # last, where a short tail still shows it
    return 1 if tests_short or peers_failed or bench_failed or moe_failed else 0


if __name__ == "__main__":
    sys.exit(main())
