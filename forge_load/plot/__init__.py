"""`forge-load plot`: a run drawn from its log (logs.py reads it, draw.py draws it, command.py is the command)."""
