"""A checkpoint that cannot be written for want of room stops with one sentence that says so
and names the checkpoint kept, and leaves no partial directory. The limit is real: a child
process whose file-size limit (RLIMIT_FSIZE) is below the checkpoint's size, SIGXFSZ ignored,
so the writes fail as on a full disk (PyTorch's stream writer reports only 'unexpected pos')."""

from __future__ import annotations

from tests.helpers import child_stdout

CHILD = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
import torch
import torch.distributed as dist
from forja.checkpoint.config import CheckpointConfig
from forja.checkpoint.manager import CheckpointManager
from forja.errors import ForjaError
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
folder = Path(sys.argv[1])
manager = CheckpointManager(CheckpointConfig(), folder, rank=0, meta={"model": "test"})
manager.save(1, {"w": torch.zeros(16)})  # small: fits
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    manager.save(2, {"w": torch.zeros(1_000_000)})  # 4 MB: does not
except ForjaError as exc:
    print("ForjaError:", exc)
"""


def test_a_checkpoint_on_a_full_disk_says_so_and_keeps_the_previous(tmp_path):
    folder = tmp_path / "checkpoints"
    out = child_stdout(CHILD, str(folder))
    assert out.startswith("ForjaError: could not write checkpoint step-00000002"), out
    assert "no space left on device" in out and "step-00000001 is intact" in out, out
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000001"]
