"""The FORGE_ variables of the project's own tools, which are no settings of the filler."""

# FORGE_ variables that the project's own scripts read (tests, the container engine, the fleet script), not
# the filler: no warning for these.
TOOL_VARIABLES = frozenset({
    "FORGE_IMAGE", "FORGE_VENV", "FORGE_SKIP_SYSTEM_TOOLS", "FORGE_REQUIRE_DOCKER", "FORGE_ENGINE_STARTED",
    "FORGE_DOCKER_DIR", "FORGE_BASE_IMAGE", "FORGE_DEBIAN_MIRROR", "FORGE_PIP_INDEX_URL",
    "FORGE_DOCKER_STORAGE_DRIVER",
})
