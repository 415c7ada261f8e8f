# syntax=docker/dockerfile:1
# One image per role, all from this file: `docker build --target <role> .`
# (`make images` builds the seven, with Docker, podman or buildah). Targets: api,
# shard-manager, projector, checkpointer, compactor, reaper, worker.
#
#   builder   the base python + the project's source: builds every wheel and a venv at
#             /opt/noetl (deploy/docker/build-venv.sh). Nothing compiles: every
#             dependency ships binary wheels. With --build-arg WHEELHOUSE=/wheelhouse it
#             asks no package index: the wheels come from deploy/docker/wheelhouse/ in the
#             build context (`make images OFFLINE=1` fills it on the host).
#   runtime   the base python + /opt/noetl only; no compilers, no pip (the base's own pip
#             and ensurepip's wheels are removed), no source tree; runs as uid/gid 10001;
#             gRPC on 50051, Prometheus /metrics on 9464.
#   <role>    runtime + the role's entry point.
#
# PYTHON_IMAGE: python:3.11-slim-bookworm, or any image with the same layout of a Python
# 3.11 with venv, e.g. the Debian bookworm one deploy/docker/base-image.sh makes without a
# registry (localhost/noetl-base:bookworm; docs/DEPLOY.md "Images").
#
# Health: every role serves grpc.health.v1 on its gRPC port. Kubernetes probes it
# natively (`grpc: {port: 50051}`, see deploy/helm/noetl); Docker uses the
# HEALTHCHECK below (deploy/docker/healthcheck.py, the same RPC).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# "" = pip asks its index; /wheelhouse = only the wheels copied there (offline)
ARG WHEELHOUSE=""
COPY deploy/docker/build-venv.sh /usr/local/bin/build-venv
COPY deploy/docker/wheelhouse/ /wheelhouse/
COPY pyproject.toml ./
COPY libs/ libs/
COPY clients/python/ clients/python/
COPY services/ services/
RUN sh /usr/local/bin/build-venv /src /opt/noetl /tmp/wheels && rm -rf /tmp/wheels /wheelhouse

FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="noetl-runtime" \
      org.opencontainers.image.description="Durable, horizontally scalable runtime for NoETL playbooks" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 noetl \
 && useradd --system --uid 10001 --gid noetl --no-create-home --home-dir /tmp --shell /usr/sbin/nologin noetl \
 && (python3 -m pip uninstall --quiet --yes pip setuptools wheel 2>/dev/null || true) \
 && rm -rf /usr/local/bin/pip /usr/local/bin/pip3* /usr/local/lib/python3*/ensurepip \
           /usr/lib/python3*/ensurepip /usr/share/python-wheels
COPY --from=builder /opt/noetl /opt/noetl
COPY deploy/docker/healthcheck.py /opt/noetl/healthcheck.py
ENV PATH=/opt/noetl/bin:${PATH} \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GRPC_ENABLE_FORK_SUPPORT=false \
    NOETL_GRPC_LISTEN=0.0.0.0:50051 \
    NOETL_METRICS_LISTEN=0.0.0.0:9464
WORKDIR /tmp
USER 10001:10001
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/noetl/healthcheck.py"]

FROM runtime AS api
ENTRYPOINT ["noetl-api"]

FROM runtime AS shard-manager
ENTRYPOINT ["noetl-shard-manager"]

FROM runtime AS projector
ENTRYPOINT ["noetl-projector"]

FROM runtime AS checkpointer
ENTRYPOINT ["noetl-checkpointer"]

FROM runtime AS compactor
ENTRYPOINT ["noetl-compactor"]

FROM runtime AS reaper
ENTRYPOINT ["noetl-reaper"]

FROM runtime AS worker
ENTRYPOINT ["noetl-worker"]
