"""Whose a directory is: reset and snapshot leave a directory that is not Keel's as it is, whatever
was run on it before; and what a symbolic link given as the state directory is said to be. Real
subprocesses on real directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_state_cli import contents, keel, users_documents


def test_a_refused_snapshot_of_a_mistyped_directory_holding_a_foreign_database_does_not_let_reset_empty_it(
    tmp_path: Path,
) -> None:
    scratch = tmp_path / "scratch"
    users_documents(scratch)  # docs/thesis.txt, photo.jpg and another program's tasks.db
    before = contents(scratch)

    snapshot = keel(tmp_path, "state", "snapshot", "--state-dir", "scratch")
    # tasks.db has no Keel identity, yet snapshot takes it (exit 0) and leaves .keel-generation.lock
    reset = keel(tmp_path, "state", "reset", "--state-dir", "scratch")

    assert reset.returncode == 1 and "is not a Keel state directory" in reset.stderr, reset.stdout
    assert set(contents(scratch)) >= set(before)  # the user's files are still there


def test_a_serve_that_refuses_a_mistyped_directory_does_not_let_reset_empty_it(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    users_documents(scratch)
    before = contents(scratch)

    serve = keel(tmp_path, "serve", "--state-dir", "scratch", "--port", "0")
    assert serve.returncode == 1 and "point the state directory at the right place" in serve.stderr
    reset = keel(tmp_path, "state", "reset", "--state-dir", "scratch")

    assert reset.returncode == 1, reset.stdout
    assert (
        "scratch is not a Keel state directory: it holds another program's database (tasks.db) and of Keel's only"
        " lock files, which a serve or snapshot refused there leaves, so reset removed nothing from it"
    ) in reset.stderr
    assert set(contents(scratch)) >= set(before)  # the user's files are still there


def test_a_refused_reset_leaves_another_programs_wal_database_as_it_was(tmp_path: Path) -> None:
    import sqlite3

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    conn = sqlite3.connect(scratch / "app.db")  # another program's database, in WAL mode, closed cleanly
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    (scratch / "notes.txt").write_text("mine\n")
    before = contents(scratch)

    reset = keel(tmp_path, "state", "reset", "--state-dir", "scratch")

    assert reset.returncode == 1 and "reset removed nothing from it" in reset.stderr
    assert contents(scratch) == before  # "left as it is": no app.db-wal / app.db-shm made by reading it


@pytest.mark.parametrize("target", ["a-file", "nowhere"])
@pytest.mark.parametrize("command", [["check"], ["state", "recover"], ["state", "reset"]])
def test_a_symbolic_link_to_no_directory_is_not_answered_give_the_directory_it_points_to(
    tmp_path: Path, target: str, command: list[str]
) -> None:
    (tmp_path / "a-file").write_text("not a directory\n")
    (tmp_path / "link").symlink_to(tmp_path / target)

    result = keel(tmp_path, *command, "--state-dir", "link")

    assert result.returncode == 1
    assert "symbolic link" in result.stderr
    assert "give the directory it points to" not in result.stderr  # it points to a file, or to nothing
