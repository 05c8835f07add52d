"""`python -m forge_load.fleet ...`: `forge-load fleet ...` without the console script, kept at this address (the
one import above its layer, declared in pyproject.toml's layers contract)."""

from forge_load.commands.fleet import main

if __name__ == "__main__":
    raise SystemExit(main())
