"""`python -m forge_load.health`: the health check, kept at its first address (the heartbeat and the check itself
live in forge_load/service/health.py)."""

from forge_load.service.health import main

if __name__ == "__main__":
    raise SystemExit(main())
