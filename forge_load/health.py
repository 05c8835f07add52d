"""`python -m forge_load.health`: the health check, kept at its first address (the Dockerfile's HEALTHCHECK); the
command is forge_load/commands/health.py."""

from forge_load.commands.health import main

if __name__ == "__main__":
    raise SystemExit(main())
