"""The commands: one module each, on top of every layer (the filler's entry point, hold/release/holds, status,
health, plot, fleet), started by forge_load/cli.py's table. A new command is a module here with
`main(argv) -> int` and one line in that table.

What they share is in one place each: the line on stderr (forge_load.log.say), the argument parser
(forge_load.config.cmdline.ArgParser), the exit codes (forge_load.exits), and bad input, the hold directory and
the host's GPUs (shared.py).
"""
