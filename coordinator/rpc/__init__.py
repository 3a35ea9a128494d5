"""gRPC servers: translate messages and errors around the replica and the node daemon."""
