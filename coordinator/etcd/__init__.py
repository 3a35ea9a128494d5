"""The etcd boundary: the store (the only code that talks to etcd) and etcd processes for up and tests."""
