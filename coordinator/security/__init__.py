"""Identity and authorization: certificates, TLS credentials, the peer's identity, the one authorization
function, bounded input and etcd's own TLS and RBAC."""
