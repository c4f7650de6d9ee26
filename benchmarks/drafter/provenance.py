"""What every drafter benchmark's result JSON starts with: the command that made it, the commit and the date."""

from __future__ import annotations

import subprocess
import sys
import time


def provenance() -> dict[str, str]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # a run of uncommitted code says so: its commit alone would name code it did not run
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    if changed.stdout.strip():
        commit += "+uncommitted"
    return {"command": " ".join(sys.argv), "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
