"""`python -m forge_load.fleet ...`: `forge-load fleet ...` without the console script."""

from forge_load.fleet.command import main

if __name__ == "__main__":
    raise SystemExit(main())
