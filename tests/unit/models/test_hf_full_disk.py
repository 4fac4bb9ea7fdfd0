"""An export onto a full disk stops with one sentence and leaves nothing behind. The disk is
made full for real: a child process whose file-size limit (RLIMIT_FSIZE) is smaller than
the weights, with SIGXFSZ ignored, so safetensors' write fails with EFBIG as on a full disk."""

from __future__ import annotations

from tests.helpers import child_stdout

CHILD = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from forja.errors import ForjaError
from forja.models import build_model, save_hf_checkpoint
model = build_model("llama", "debug")
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    save_hf_checkpoint(model, sys.argv[1])
except ForjaError as exc:
    print("ForjaError:", exc)
"""


def test_an_export_onto_a_full_disk_says_so_and_leaves_nothing(tmp_path):
    out = tmp_path / "hf"
    printed = child_stdout(CHILD, str(out))
    assert printed.startswith(f"ForjaError: no space left on device writing {out}"), printed
    assert "nothing was left behind" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no export, no temporary directory
