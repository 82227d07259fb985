"""mmrag/adapters/files: the atomic, durable file write every writer of a shared file goes through."""

from __future__ import annotations

import os
import stat

import pytest

from mmrag.adapters.files import atomic_file, write_atomically


def test_a_write_replaces_the_whole_file_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "sub" / "entry.bin"
    write_atomically(target, b"old", prefix=".tmp-1-")
    write_atomically(target, "new ✓", prefix=".tmp-1-", mode=0o600)
    assert target.read_text(encoding="utf-8") == "new ✓"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["entry.bin"]


def test_a_write_that_fails_half_way_keeps_the_old_file_and_removes_its_temp_file(tmp_path):
    target = tmp_path / "tenants.json"
    write_atomically(target, b"old")
    with pytest.raises(RuntimeError), atomic_file(tmp_path, prefix=".upload-") as out:
        out.write(b"half of the new")
        raise RuntimeError("the client left")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["tenants.json"]


def test_a_temp_file_never_committed_is_removed_and_one_named_late_lands_in_another_folder(tmp_path):
    with atomic_file(tmp_path, prefix=".upload-") as out:
        out.write(b"refused")
    assert os.listdir(tmp_path) == []
    with atomic_file(tmp_path, prefix=".upload-") as out:
        out.write(b"%PDF")
        (tmp_path / "ab12").mkdir()
        out.commit(tmp_path / "ab12" / "report.pdf")  # named by its hash, known only once written
    assert (tmp_path / "ab12" / "report.pdf").read_bytes() == b"%PDF" and os.listdir(tmp_path) == ["ab12"]
