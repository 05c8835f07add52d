"""The containers of a Docker host, for `forge-load fleet` (the command, its flags and exit codes:
forge_load/commands/fleet.py).

plan.py decides what each GPU's container should be (no engine); containers.py runs up, down, status and logs
against the engine; watch.py holds the GPUs of the containers that ask for them; engine.py connects to the
engine. The docker SDK is imported only inside the functions that use the engine. Nothing here imports CUDA or
numba: NVML (pynvml) only through forge_load.gpu.nvml.
"""
