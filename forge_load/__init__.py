"""forge_load: keep a GPU at a target utilization, step aside for real work."""

__version__ = "0.1.0"
