"""The deterministic-mode check: two runs of one config with `debug.deterministic: true` logged
bitwise the same losses. python tools/gpu/same_losses.py RUN_DIR_A RUN_DIR_B; exit 1 if not."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


def main() -> int:
    first, second = (losses(Path(arg)) for arg in sys.argv[1:3])
    if not first:
        print(f"no losses logged in {sys.argv[1]}")
        return 1
    differ = {
        step: (loss, second.get(step)) for step, loss in first.items() if second.get(step) != loss
    }
    if differ or first.keys() != second.keys():
        print(f"losses differ between the two runs (step: first, second): {differ}")
        return 1
    print(f"{len(first)} logged losses bitwise equal; last {first[max(first)]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
