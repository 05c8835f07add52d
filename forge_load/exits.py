"""Every exit code of every forge-load command, the filler's included: what scripts, Docker's HEALTHCHECK, Slurm's
prolog and systemd read, so each is named once here and each command's docstring says which of them it uses.

It sits at the bottom of the layers because the service decides the filler's codes deep in its run loops
(service/gpu_threads.py), and the commands above it decide their own.
"""

from __future__ import annotations

# Every command: done.
EXIT_OK = 0

# The filler (`forge-load` without a command; service/app.py says when each applies).
EXIT_INTERNAL = 1  # a bug, said in one line
EXIT_CONFIG = 2  # a bad setting, too few open files, or GPUs another filler of this user fills
EXIT_NO_GPU = 3  # no usable GPU or NVML
EXIT_GPU_FAILED = 4  # a GPU failed while running
EXIT_LOG_LOST = 5  # stdout could not be written: the fillers stopped as for a signal
# The exclusive-mode child (service/exclusive_child.py, read by its supervisor only): it could not take its context
# lock, so it created no context (`hold --wait` could not have seen it).
EXIT_NO_CONTEXT_LOCK = 6

# hold, release, holds, status, plot: bad input in one line (or a hold directory that cannot be used).
EXIT_BAD_INPUT = 2
# hold --wait: a named GPU's filler did not acknowledge in time (the hold stays).
EXIT_NOT_ACKNOWLEDGED = 1
# plot: matplotlib, the optional extra, is not installed.
EXIT_NO_MATPLOTLIB = 1

# health: Docker's HEALTHCHECK reads 0 healthy, 1 unhealthy, and reserves 2, which health never returns.
EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1

# fleet: an error said in one line (the engine, the image, a GPU, a container not ours); bad usage or a setting the
# filler would refuse; interrupted (Ctrl-C), as a shell reports SIGINT.
EXIT_FLEET_FAILED = 1
EXIT_FLEET_USAGE = 2
EXIT_INTERRUPTED = 130
