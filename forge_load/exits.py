"""Every exit code of every forge-load command, the filler's included: what scripts, Docker's HEALTHCHECK, Slurm's
prolog and systemd read, so each is named once here and each command's docstring says which of them it uses.

It sits at the bottom of the layers because the service decides the filler's codes deep in its run loops
(service/gpu_threads.py), and the commands above it decide their own.
"""

from __future__ import annotations

# Every command: done.
EXIT_OK = 0
# Every command, the filler's --help included (forge_load/cli.py): stdout could not be written (closed, full), said in
# one line on stderr; or the reader of its pipe stopped reading (`| head -1`), said in none, as a shell reports a tool
# that SIGPIPE ended (128 + 13). The filler's log has its own: EXIT_LOG_LOST.
EXIT_OUTPUT_LOST = 5
EXIT_BROKEN_PIPE = 141

# The filler (`forge-load` without a command; service/app.py says when each applies).
EXIT_INTERNAL = 1  # a bug, said in one line
EXIT_CONFIG = 2  # a bad setting, too few open files, or GPUs another filler of this user fills
EXIT_NO_GPU = 3  # no usable GPU or NVML
EXIT_GPU_FAILED = 4  # a GPU failed while running
EXIT_LOG_LOST = 5  # stdout could not be written (a closed pipe too): the fillers stopped as for a signal
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

# What each code means to whoever reads it, by who returns it: the man page's EXIT STATUS (scripts/gen_docs.py);
# docs/operating.md says more.
EXIT_STATUS: tuple[tuple[str, tuple[tuple[int, str], ...]], ...] = (
    ("forge-load, the filler", (
        (EXIT_OK, "stopped normally: FORGE_DURATION, or SIGTERM, SIGINT or SIGHUP"),
        (EXIT_INTERNAL, "an internal error (a bug), said in one line"),
        (EXIT_CONFIG, "bad configuration: a setting, too few open files (ulimit -n), or GPUs another filler of this "
                      "user fills"),
        (EXIT_NO_GPU, "no usable GPU or NVML, a GPU on which no foreign job can be seen, or one that no kernel image "
                      "loads on: an error line says why"),
        (EXIT_GPU_FAILED, "a GPU failed while running"),
        (EXIT_LOG_LOST, "the log could not be written (stdout closed or full, or its reader gone): the fillers "
                        "stopped as for a signal"),
        (EXIT_NO_CONTEXT_LOCK, "exclusive compute mode's child only, read by its supervisor: it could not take "
                               "its context lock, so it made no context"),
    )),
    ("every command (forge-load COMMAND), and the filler's --help", (
        (EXIT_OUTPUT_LOST, "stdout could not be written (closed or full), said in one line on stderr"),
        (EXIT_BROKEN_PIPE, "the reader of stdout stopped reading (| head): a quiet end, as a shell reports a tool "
                           "that SIGPIPE ended"),
    )),
    ("status, hold, release, holds, plot", (
        (EXIT_OK, "done"),
        (EXIT_NOT_ACKNOWLEDGED, "hold --wait: a GPU's filler did not acknowledge in time (the hold stays); plot: "
                                "matplotlib is not installed"),
        (EXIT_BAD_INPUT, "bad input, said in one line"),
    )),
    ("health", (
        (EXIT_HEALTHY, "healthy"),
        (EXIT_UNHEALTHY, "unhealthy, or a setting it cannot read (never 2, which Docker reserves)"),
    )),
    ("fleet", (
        (EXIT_OK, "done"),
        (EXIT_FLEET_FAILED, "an error said in one line: the engine, the image, a GPU, a container not ours"),
        (EXIT_FLEET_USAGE, "bad usage, or a setting the filler would refuse"),
        (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
    )),
)
