# forge_load: one container per GPU, keeping it at a target utilization.
#
#   docker build -t forge-load .
#   docker run -d --gpus device=0 -e FORGE_TARGET=0.5 --name forge_load_gpu_0 forge-load
#
# BASE_IMAGE is any Debian-like image with python3 and its venv module: python:3.12-slim by default; CI
# builds on a local debootstrap'd bookworm (scripts/docker_engine.sh; Python 3.11 at /usr/bin/python3).
# The driver's libcuda and libnvidia-ml are NOT in the image: the NVIDIA Container Toolkit mounts them from
# the host at `docker run --gpus ...`. The image holds the runtime only: the kernel comes compiled, one cubin
# per GPU architecture and its PTX (forge_load/gpu/prebuilt, written by scripts/build_kernels.py and checked
# by the tests), loaded through the driver API (cuda-bindings); no numba, llvmlite or CUDA compiler. Any CUDA
# 12 driver (>= 525.60.13) loads the cubins, and NVIDIA_REQUIRE_CUDA makes the toolkit refuse older drivers at
# `docker run` with a clear message. No NVIDIA_VISIBLE_DEVICES here: which GPU a container gets is said at `docker run` (--gpus
# device=N, or NV_GPU=N with nvidia-docker); an image that defaulted to "all" would quietly take every GPU on
# hosts whose default runtime is nvidia.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

# Used only while building, never kept in the image's environment: where pip finds packages and which CA
# bundle it trusts (a build behind an intercepting proxy passes /etc/ssl/certs/ca-certificates.crt).
ARG PIP_INDEX_URL
ARG PIP_CERT
ARG BASE_IMAGE
ARG VERSION=0.1.0

# The image's settings come first, while its filesystem is small: every instruction after the big pip layer
# costs a full copy of it on some storage drivers (vfs). The revision label is added by
# `docker build --label org.opencontainers.image.revision=...`, so a new commit does not void the cache.
# io.forge_load.role=gpu-filler is on every container of this image: `docker ps --filter
# label=io.forge_load.role=gpu-filler` finds the fillers of a host, whoever started them.
LABEL org.opencontainers.image.title="forge-load" \
      org.opencontainers.image.description="Keeps a GPU at a target utilization and steps aside the instant real work arrives" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.forge_load.role="gpu-filler"

ENV PATH=/opt/forge/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=12.0"

# Fails when the filler's loop has not written its heartbeat for FORGE_HEALTH_MAX_AGE seconds (default 30), or
# (with FORGE_METRICS_PORT) when its /health says so; it reads the same settings as the filler. The heartbeat
# is at its default place, /tmp/forge_load-10001/heartbeat-gpu0 (named after FORGE_GPU/FORGE_GPUS, which the
# check reads too): a directory of the filler's user, mode 0700.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "forge_load.health"]

# Exec form: the filler is PID 1 and gets docker stop's SIGTERM itself (it exits 0 within a second). Its
# handlers are installed before anything else it imports; `docker run --init` closes the last gap (the
# interpreter's own start-up, during which the kernel drops a signal to a PID 1 without a handler).
ENTRYPOINT ["forge-load"]

# A non-root user, with no home and no shell.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin forge

# The dependencies next, in a layer of their own: they change far less often than the code. Left out in the
# same layer, so they never reach the image: the packages' own test suites, never imported at run time, and
# the files of the wheels that the filler never reads (cuda-bindings' Cython sources; see scripts/image_prune.py
# and docs/deploying.md). image_prune.py fails the build if a wheel no longer matches what was measured.
COPY requirements.txt scripts/image_prune.py /tmp/forge-build/
RUN python3 -m venv /opt/forge \
    && pip install --no-cache-dir -r /tmp/forge-build/requirements.txt \
    && find /opt/forge/lib -depth -type d -path '*/site-packages/*' -name tests -exec rm -rf {} + \
    && python /tmp/forge-build/image_prune.py \
    && rm -rf /tmp/forge-build

COPY . /tmp/forge-src
RUN pip install --no-cache-dir --no-deps /tmp/forge-src \
    && rm -rf /tmp/forge-src

USER 10001:10001
