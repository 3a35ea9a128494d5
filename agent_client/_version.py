"""The client's version, sent in OpenSession: the installed distribution's (pyproject.toml holds the one
written copy); a source tree used without installing it (no distribution metadata) says so."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpucoord")
except PackageNotFoundError:
    __version__ = "0+unknown"
