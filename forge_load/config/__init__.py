"""The daemon's settings: read from the environment, overridden by command-line flags, every value checked.

values.py reads one value (and says what it accepts); settings.py is the table of settings and Config;
sim.py the simulated GPU's settings; load.py builds the Config (load_config) and checks values against each
other; cmdline.py the table of commands and the argument parser they all use; heartbeat.py the heartbeat's timing;
tools.py the variables of the project's own tools. Nothing here touches the GPU.
"""
