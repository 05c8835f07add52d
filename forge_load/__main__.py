from forge_load.cli import entry

entry()
