"""forja.files: nothing half-written is ever left under a final name."""

import os

import pytest

from forja import files
from forja.errors import ForjaError
from forja.files import check_writable, read_records, replace_dir, write_atomic


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("data, expected", [("héllo\n", "héllo\n".encode()), (b"\x00\xffraw", b"\x00\xffraw")])
def test_write_atomic_writes_str_and_bytes_and_leaves_no_temporary(tmp_path, data, expected):
    target = tmp_path / "out.txt"
    write_atomic(target, data)
    assert target.read_bytes() == expected
    assert _names(tmp_path) == ["out.txt"]


def test_write_atomic_replaces_an_existing_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    write_atomic(target, "new")
    assert target.read_text() == "new" and _names(tmp_path) == ["out.txt"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "out.txt"
    target.write_text("old")
    real_fsync = os.fsync

    def fsync(fd):
        os.write(fd, b"half")  # something reached the temporary file...
        raise OSError(28, "No space left on device")  # ...then the disk filled

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="^no space left on device writing .*out.txt: nothing is half-written "
                                      r"\(the previous out.txt is kept whole\)"):
        write_atomic(target, "new content")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert target.read_text() == "old"
    assert _names(tmp_path) == ["out.txt"]


def test_a_failed_rename_leaves_no_temporary_and_no_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        write_atomic(tmp_path / "out.txt", b"data")
    assert _names(tmp_path) == []


def test_a_bad_payload_leaves_no_temporary(tmp_path):
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "out.txt", 123)  # neither str nor bytes
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "out.txt", object())
    assert _names(tmp_path) == []


def test_check_writable_creates_the_folder_and_leaves_no_probe(tmp_path):
    folder = tmp_path / "a" / "b"
    check_writable(folder, what="run directory", fix="choose another", rank=3)
    assert folder.is_dir() and _names(folder) == []


def test_check_writable_names_the_folder_and_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    folder = blocker / "runs"  # under a regular file: cannot exist
    with pytest.raises(ForjaError) as err:
        check_writable(folder, what="run directory", fix="choose another run.dir")
    message = str(err.value)
    assert message.startswith(f"run directory {folder} cannot be written (")
    assert message.endswith("; choose another run.dir")
    assert err.value.__cause__ is None and err.value.__suppress_context__


def _tree(folder, text):
    folder.mkdir()
    (folder / "sub").mkdir()
    (folder / "sub" / "f.txt").write_text(text)
    return folder


def test_replace_dir_moves_a_new_directory_into_place(tmp_path):
    new = _tree(tmp_path / ".out.tmp", "new")
    replace_dir(new, tmp_path / "out")
    assert (tmp_path / "out" / "sub" / "f.txt").read_text() == "new"
    assert _names(tmp_path) == ["out"]


@pytest.mark.parametrize("old_is_dir", [True, False])
def test_replace_dir_removes_the_old_only_after_the_new_is_in_place(tmp_path, monkeypatch, old_is_dir):
    out = _tree(tmp_path / "out", "old") if old_is_dir else tmp_path / "out"
    if not old_is_dir:
        out.write_text("old file")
    new = _tree(tmp_path / ".out.tmp", "new")
    seen = []
    real_rmtree = files.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        seen.append((out / "sub" / "f.txt").read_text())  # what `out` holds when the old goes
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(files.shutil, "rmtree", rmtree)
    replace_dir(new, out)
    assert (out / "sub" / "f.txt").read_text() == "new"
    assert _names(tmp_path) == ["out"]
    if old_is_dir:
        assert seen == ["new"]


def test_replace_dir_puts_the_old_back_when_the_move_fails(tmp_path, monkeypatch):
    out = _tree(tmp_path / "out", "old")
    new = _tree(tmp_path / ".out.tmp", "new")
    real_replace = os.replace

    def replace(src, dst):
        if str(src) == str(new):
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output"):
        replace_dir(new, out)
    assert (out / "sub" / "f.txt").read_text() == "old"
    assert _names(tmp_path) == [".out.tmp", "out"]  # the caller removes its temporary


def test_replace_dir_keep_existing_lets_the_first_finisher_win(tmp_path):
    out = _tree(tmp_path / "out", "first")
    new = _tree(tmp_path / ".out.tmp", "second")
    replace_dir(new, out, keep_existing=True)
    assert (out / "sub" / "f.txt").read_text() == "first"
    assert _names(tmp_path) == ["out"]


def test_replace_dir_keep_existing_still_moves_into_a_free_name(tmp_path):
    new = _tree(tmp_path / ".out.tmp", "new")
    replace_dir(new, tmp_path / "out", keep_existing=True)
    assert (tmp_path / "out" / "sub" / "f.txt").read_text() == "new"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc")
def test_replace_dir_flushes_every_file_before_the_rename(tmp_path, monkeypatch):
    new = _tree(tmp_path / ".out.tmp", "new")
    (new / "top.bin").write_bytes(b"x")
    synced, real_fsync = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    replace_dir(new, tmp_path / "out")
    assert {str(new / "top.bin"), str(new / "sub" / "f.txt")} <= set(synced)
    assert str(tmp_path) in synced  # the rename itself


def test_read_records_skips_torn_lines_and_strict_names_a_bad_one_inside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_records(path) == []  # no file: no records
    path.write_text('{"step": 1}\n\n[3]\ngarbage\n{"step": 2}\n{"step": 3, "lo')
    assert read_records(path) == [{"step": 1}, {"step": 2}]  # torn, foreign and blank lines skipped
    with pytest.raises(ForjaError, match=r"metrics.jsonl line 3 is not JSON .*; fix or remove that line"):
        read_records(path, strict=True)  # blank lines are not counted
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_records(path, strict=True) == [{"step": 1}]  # a torn last line is a run that died
