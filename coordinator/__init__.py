from importlib.metadata import PackageNotFoundError, version

# pyproject.toml holds the one written copy of the version; a source tree used without installing it
# (no distribution metadata) says so instead of claiming a release.
try:
    __version__ = version("gpucoord")
except PackageNotFoundError:
    __version__ = "0+unknown"
