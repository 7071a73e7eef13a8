"""The third-party wheels the accelerator machine lacks, read from `uv pip compile
--annotation-style line` of the llmtrain packages for its Python and platform:

    python tools/gpu/missing.py COMPILED.txt

Prints one `name==version` a line: each resolved distribution that is needed (an llmtrain
package, or something a needed distribution requires) and not already on that machine
(machine_packages.txt). A package the machine has is not followed: its own dependencies are
there too, at the versions it was installed with.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MACHINE_PACKAGES = Path(__file__).with_name("machine_packages.txt")
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)\s*(?:#\s*via\s+(.*))?$")


def normalize(name: str) -> str:
    """PEP 503: `Typing_Extensions` and `typing-extensions` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages() -> set[str]:
    lines = MACHINE_PACKAGES.read_text().splitlines()
    return {normalize(line) for line in lines if line.strip() and not line.startswith("#")}


def parse(compiled: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, the names that require it); `-r file` parents are dropped."""
    pins = {}
    for line in compiled.splitlines():
        if match := PIN.match(line.strip()):
            name, version, via = match.groups()
            parents = {normalize(p) for p in (via or "").split(",") if p.strip()}
            pins[normalize(name)] = (version, {p for p in parents if not p.startswith("-r")})
    return pins


def missing(pins: dict[str, tuple[str, set[str]]], present: set[str]) -> list[str]:
    needed = {name for name in pins if name.startswith("llmtrain")}
    grew = True
    while grew:  # a package is needed when something needed (and not present) requires it
        followed = needed - present
        grown = {n for n, (_, parents) in pins.items() if parents & followed} | needed
        grew, needed = grown != needed, grown
    return sorted(
        f"{name}=={pins[name][0]}"
        for name in needed
        if not name.startswith("llmtrain") and name not in present
    )


def main() -> None:
    pins = parse(Path(sys.argv[1]).read_text())
    print("\n".join(missing(pins, machine_packages())))


if __name__ == "__main__":
    main()
