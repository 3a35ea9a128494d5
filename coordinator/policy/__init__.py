"""Pure policy: admission decisions and partitions. No I/O; importing it loads neither aetcd nor grpc."""
