"""tools/check_release.py, the check run before a release is tagged, on real git repositories."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import ROOT

SCRIPT = ROOT / "tools" / "check_release.py"
CHANGELOG = "# Changelog\n\n## [Unreleased]\n\n## [{v}] - 2026-11-26\n\n### Added\n- x\n"


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def commit(repo: Path, subject: str) -> None:
    (repo / "n.txt").write_text(subject, encoding="utf-8")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", subject)


def check(repo: Path, *flags: str) -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--repo", str(repo), *flags], capture_output=True, text=True
    )
    return done.returncode, done.stdout.splitlines()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "VERSION").write_text('VERSION = "0.2.0"\n', encoding="utf-8")
    (tmp_path / "CHANGELOG.md").write_text(CHANGELOG.format(v="0.2.0"), encoding="utf-8")
    commit(tmp_path, "an old subject that ran far past the limit of seventy-two characters, once")
    git(tmp_path, "tag", "v0.1.0")
    commit(tmp_path, "release 0.2.0")
    return tmp_path


def test_a_release_in_order_passes(repo):
    git(repo, "tag", "v0.2.0")
    assert check(repo, "--tagged") == (0, [])


def test_long_subjects_since_the_newest_tag_are_named(repo):
    commit(repo, "x" * 73)
    rc, lines = check(repo)
    assert rc == 1 and len(lines) == 1 and "subject of 73 characters" in lines[0]


def test_a_changelog_behind_version_is_named(repo):
    (repo / "VERSION").write_text('VERSION = "0.3.0"\n', encoding="utf-8")
    rc, lines = check(repo)
    assert rc == 1 and lines == [
        "CHANGELOG.md: the newest release is 0.2.0, VERSION says 0.3.0; bump VERSION and move "
        "the Unreleased entries under a heading for it"
    ]


def test_a_missing_tag_or_unreleased_section_is_named(repo):
    (repo / "CHANGELOG.md").write_text("## [0.2.0] - 2026-11-26\n", encoding="utf-8")
    rc, lines = check(repo, "--tagged")
    assert rc == 1
    assert any("no '## [Unreleased]' section" in line for line in lines)
    assert any("no tag v0.2.0" in line for line in lines)


def test_this_repository_changelog_names_its_version():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import check_release
    finally:
        sys.path.remove(str(SCRIPT.parent))
    version = check_release.read_version((ROOT / "VERSION").read_text(encoding="utf-8"))
    assert check_release.changelog_problems(ROOT, version) == []
