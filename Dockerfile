# The service's own image. It drives the host's Docker engine through its socket
# (see docker-compose.yml); sandboxes are sibling containers, not nested ones.
#
#   docker build -t ptc-sandbox .                                   # with a registry
#   deploy/build-service-image.sh                                   # offline: wheels made on the host
#
# BASE_IMAGE: any image with python3 >= 3.11 (pip comes from the wheelhouse when it has none):
# python:3.12-slim with a registry, ptc-sandbox-base:bookworm (sandbox_image/build.sh --base offline) without.
#
# The service runs as uid 10002 ("ptc"), not root, and not the sandbox user (10001): a script never owns
# a file of the service. To reach the engine it needs the socket's group (compose: group_add with
# PTC_DOCKER_GID). Whoever holds the engine socket can start any container: treat the service as root on
# its host all the same; non-root only narrows what a bug in the service process itself can touch.
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY pyproject.toml README.md /src/
COPY service /src/service
# The runtime's package ships with the service too: both sides of the control socket import ptc_runtime.protocol.
COPY sandbox_image/ptc_runtime /src/sandbox_image/ptc_runtime
COPY deploy/wheels /src/wheels
# With a wheelhouse (deploy/wheels holds *.whl, pip's included) install offline; else from the index.
RUN set -eu; \
    if ls /src/wheels/pip-*.whl >/dev/null 2>&1; then \
      python3 "$(ls /src/wheels/pip-*.whl | head -n 1)/pip" install --no-cache-dir --no-index \
        --find-links /src/wheels --break-system-packages --root-user-action=ignore ptc-sandbox; \
    else \
      python3 -m pip install --no-cache-dir --root-user-action=ignore /src; \
    fi; \
    rm -rf /src; \
    grep -q '^ptc:' /etc/passwd || echo 'ptc:x:10002:10002:ptc-sandbox service:/var/lib/ptc-sandbox:/usr/sbin/nologin' >> /etc/passwd; \
    grep -q '^ptc:' /etc/group || echo 'ptc:x:10002:' >> /etc/group; \
    mkdir -p /var/lib/ptc-sandbox; \
    chown 10002:10002 /var/lib/ptc-sandbox; \
    chmod 700 /var/lib/ptc-sandbox; \
    ptc-sandbox --help >/dev/null; \
    python3 -c 'import ptc_runtime.protocol'

LABEL org.opencontainers.image.title="ptc-sandbox" \
      org.opencontainers.image.description="Execution service for Programmatic Tool Calling" \
      io.ptc-sandbox.role="service"
ENV PTC_HOST=0.0.0.0 PTC_PORT=8080 HOME=/var/lib/ptc-sandbox
USER 10002:10002
WORKDIR /var/lib/ptc-sandbox
EXPOSE 8080
# Liveness only (the process answers): /readyz also needs the engine and the sandbox image.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PTC_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["ptc-sandbox", "serve"]
