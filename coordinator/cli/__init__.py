"""The ``gpucoord`` command line."""
