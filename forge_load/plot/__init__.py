"""A run drawn from its log, for `forge-load plot` (forge_load/commands/plot.py): logs.py reads it, draw.py draws it."""
