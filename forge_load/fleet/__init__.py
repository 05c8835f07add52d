"""`forge-load fleet`: the operator's tool for the containers of a Docker host (command.py says what it does).

plan.py decides what each GPU's container should be (no engine); commands.py runs up, down, status and logs
against the engine; watch.py holds the GPUs of the containers that ask for them; engine.py connects to the
engine. The docker SDK is imported only inside the functions that use the engine. Nothing here imports CUDA or
numba: NVML (pynvml) only through forge_load.gpu.nvml.
"""
