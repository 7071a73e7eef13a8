"""Check the repository before a release is tagged (CHANGELOG.md says how releases are made).

    python tools/check_release.py [--repo DIR]

- CHANGELOG.md has an `## [Unreleased]` section and its newest release heading is
  `## [VERSION] - YYYY-MM-DD`, VERSION being the `VERSION` file's.
- Every commit subject since the newest `v*` tag fits 72 characters (a body says the why).
- With `--tagged`: the tag `vVERSION` exists and its commit's `VERSION` file reads VERSION.

Prints one line per problem and exits 1 when there is any, 0 otherwise.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

SUBJECT_LIMIT = 72
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", re.M)


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def changelog_problems(repo: Path, version: str) -> list[str]:
    path = repo / "CHANGELOG.md"
    if not path.is_file():
        return ["CHANGELOG.md is missing"]
    text = path.read_text(encoding="utf-8")
    problems = []
    if "## [Unreleased]" not in text:
        problems.append("CHANGELOG.md: no '## [Unreleased]' section for the changes to come")
    releases = RELEASE.findall(text)
    if not releases:
        problems.append("CHANGELOG.md: no release heading '## [X.Y.Z] - YYYY-MM-DD'")
    elif releases[0] != version:
        problems.append(
            f"CHANGELOG.md: the newest release is {releases[0]}, VERSION says {version}; "
            "bump VERSION and move the Unreleased entries under a heading for it"
        )
    return problems


def newest_tag(repo: Path) -> str | None:
    tags = git(repo, "tag", "--list", "v*", "--sort=-creatordate").split()
    return tags[0] if tags else None


def subject_problems(repo: Path) -> list[str]:
    tag = newest_tag(repo)
    span = f"{tag}..HEAD" if tag else "HEAD"
    problems = []
    for line in git(repo, "log", "--format=%h %s", span).splitlines():
        commit, _, subject = line.partition(" ")
        if len(subject) > SUBJECT_LIMIT:
            problems.append(
                f"commit {commit}: subject of {len(subject)} characters (at most "
                f"{SUBJECT_LIMIT}; the why goes in the body): {subject[:60]}..."
            )
    return problems


def tag_problems(repo: Path, version: str) -> list[str]:
    tag = f"v{version}"
    if tag not in git(repo, "tag", "--list", tag).split():
        return [f"no tag {tag}: tag the commit that sets VERSION ({version})"]
    tagged = read_version(git(repo, "show", f"{tag}:VERSION"))
    if tagged != version:
        return [f"tag {tag} is on a commit whose VERSION reads {tagged}"]
    return []


def read_version(text: str) -> str:
    """The version in a `VERSION` file (`VERSION = "X.Y.Z"`, read by hatchling's regex source)."""
    match = re.search(r'VERSION = "([^"]+)"', text)
    if match is None:
        raise SystemExit(f'VERSION does not read VERSION = "X.Y.Z": {text.strip()!r}')
    return match.group(1)


def problems(repo: Path, *, tagged: bool) -> list[str]:
    version = read_version((repo / "VERSION").read_text(encoding="utf-8"))
    found = changelog_problems(repo, version) + subject_problems(repo)
    return found + (tag_problems(repo, version) if tagged else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--tagged", action="store_true", help="also check the release's tag")
    args = parser.parse_args(argv)
    found = problems(args.repo, tagged=args.tagged)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
