"""Docker Compose for the compose tests: the v2 plugin (``docker compose``), or else Debian's ``docker-compose``."""
from __future__ import annotations

import shutil
import subprocess


def compose_command() -> list[str] | None:
    """The command that runs Compose here, or None."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy and subprocess.run([legacy, "version"], capture_output=True).returncode == 0:
        return [legacy]
    return None
