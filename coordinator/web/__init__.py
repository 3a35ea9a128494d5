"""The read-only fleet console: HTML pages of the status document that ``gpucoord status --json`` prints,
and the events seen between two of them, pushed to the open pages over Server-Sent Events.

It renders the document it is handed (the coordinator makes it with GetStatus's own code,
``coordinator.rpc.coordinator_server``) and is served on the coordinator's /metrics port
(``coordinator.metrics_http``, which guards it with TLS).
"""
