"""mTLS for the agent's channels: a CA, a certificate and its key, from arguments or the environment.

``GPUCOORD_TLS_CA``, ``GPUCOORD_TLS_CERT`` and ``GPUCOORD_TLS_KEY`` are read automatically, so a program
that uses ``agent_client`` runs securely when started with them (``gpucoord up --secure`` prints them).
All three or none; none means plaintext (a coordinator on loopback in dev mode).
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import grpc

ENV = ("GPUCOORD_TLS_CA", "GPUCOORD_TLS_CERT", "GPUCOORD_TLS_KEY")


def files(ca: str | None = None, cert: str | None = None, key: str | None = None,
          env: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """The CA, certificate and key files from the arguments, else the environment ("" for none)."""
    env = os.environ if env is None else env
    ca_file, cert_file, key_file = (given or env.get(var, "") for given, var in zip((ca, cert, key), ENV))
    return ca_file, cert_file, key_file


def credentials(ca: str | None = None, cert: str | None = None, key: str | None = None,
                env: Mapping[str, str] | None = None) -> grpc.ChannelCredentials | None:
    """Channel credentials from the arguments, else the environment; None when neither gives any."""
    paths = files(ca, cert, key, env)
    if not any(paths):
        return None
    missing = [var for p, var in zip(paths, ENV) if not p]
    if missing:
        raise ValueError(f"tls: {missing[0]} (or its argument) is missing: TLS needs a CA, a certificate and a key")
    data = []
    for p, var in zip(paths, ENV):
        try:
            with open(p, "rb") as f:
                data.append(f.read())
        except OSError as e:
            raise ValueError(f"tls: cannot read {p} ({var}): {e.strerror}") from None
    return grpc.ssl_channel_credentials(root_certificates=data[0], private_key=data[2], certificate_chain=data[1])


def aio_channel(address: str, creds: grpc.ChannelCredentials | None,
                options: Sequence[tuple[str, int | str]] = ()) -> grpc.aio.Channel:
    if creds is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, creds, options=list(options))
