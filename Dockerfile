# The service's own image. It drives the host's Docker engine through its socket
# (see docker-compose.yml); sandboxes are sibling containers, not nested ones.
#
#   docker build -t ptc-sandbox .                                   # with a registry
#   deploy/build-service-image.sh                                   # offline: wheels made on the host
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY pyproject.toml README.md /src/
COPY service /src/service
COPY deploy/wheels /src/wheels
# With a wheelhouse (deploy/wheels holds *.whl, pip's included) install offline; else from the index.
RUN set -eu; \
    if ls /src/wheels/pip-*.whl >/dev/null 2>&1; then \
      python3 "$(ls /src/wheels/pip-*.whl | head -n 1)/pip" install --no-cache-dir --no-index \
        --find-links /src/wheels --break-system-packages --root-user-action=ignore ptc-sandbox; \
    else \
      python3 -m pip install --no-cache-dir --root-user-action=ignore /src; \
    fi; \
    rm -rf /src/wheels

ENV PTC_HOST=0.0.0.0 PTC_PORT=8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz')"
ENTRYPOINT ["ptc-sandbox", "serve"]
