"""One coordinator replica: the service, per-host admitters, the leader duties, the watch-fed mirror."""
