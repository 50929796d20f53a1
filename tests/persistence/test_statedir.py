"""The state directory's own words: why one cannot be used, never an errno."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from persistence.statedir import UnusableStateDir, refusal, try_state_dir


@pytest.mark.parametrize(
    ("code", "euid", "said"),
    [
        (errno.ENOENT, 0, "its file system takes no new files"),  # what /proc answers a directory that is there
        (errno.EOPNOTSUPP, 1000, "its file system takes no new files"),
        (errno.EROFS, 1000, "its file system is read-only"),
        (errno.ENOSPC, 1000, "its file system is full"),
        (errno.EDQUOT, 1000, "this user's disk quota is used up"),
        (errno.EACCES, 1000, "this user may not write in it"),
        (errno.EPERM, 1000, "this user may not write in it"),
        (errno.EACCES, 0, "not even root may write in it"),  # what /sys answers root
        (errno.EMLINK, 1000, os.strerror(errno.EMLINK)),
    ],
)
def test_why_a_file_cannot_be_made_in_a_directory_is_said_in_plain_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, euid: int, said: str
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    assert refusal(OSError(code, os.strerror(code)), "files", tmp_path) == said


def test_a_directory_removed_meanwhile_is_said_to_be_gone(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    assert refusal(OSError(errno.ENOENT, os.strerror(errno.ENOENT)), "files", gone) == "it no longer exists"


def test_trying_a_state_directory_leaves_nothing_and_names_what_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    try_state_dir(tmp_path / "state")
    try_state_dir(tmp_path / "new" / "state")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["state"]
    (tmp_path / "a-file").write_text("not a directory")
    for path, why in (
        (tmp_path / "a-file", "it is a file, not a directory"),
        (tmp_path / "a-file" / "state", f"{tmp_path / 'a-file'} is a file, so no directory can be made under it"),
    ):
        with pytest.raises(UnusableStateDir) as caught:
            try_state_dir(path)
        assert caught.value.why == why
