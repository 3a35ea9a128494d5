"""etcd as gpucoord uses it: which servers are safe, and (later) the store, sessions and processes."""
