"""The bench's phases: each starts its own rig, measures gpucoord and its baseline, and returns its lines.

``latency`` P1 and P2, ``contended`` P4 (and the side-by-side), ``throughput`` P3, ``scale`` P5,
``idle_reclaim`` P8 and P6, ``notice`` P7.
"""
