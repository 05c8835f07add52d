"""A run drawn from its log, for `forge-load plot` (forge_load/commands/plot.py): logs.py reads it (lines.py a line,
series.py what each GPU's lines add up to), draw.py draws it."""
