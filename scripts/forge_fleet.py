#!/usr/bin/env python3
"""The fleet tool's first address: `python3 scripts/forge_fleet.py up|down|status|logs|watch ...` runs
`forge-load fleet ...` (forge_load/commands/fleet.py), from this checkout even where forge_load is not installed
(the docker SDK is all it needs then, as before)."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # forge_load from this checkout
    from forge_load.commands.fleet import main

    raise SystemExit(main(prog="forge_fleet.py"))
