# cachegate: OpenAI-compatible local proxy for LLM agents.
#   docker build -t cachegate .
#   docker run -p 127.0.0.1:8787:8787 -v "$PWD/config:/config:ro" -v cachegate-logs:/logs cachegate
# It listens on 0.0.0.0 inside the container so that a port mapping can reach it; publish the port
# on 127.0.0.1 (as above and in docker-compose.yml) to keep it off the network.
FROM python:3.11-slim

# CACHEGATE_LOG_DIR: `docker exec <container> cachegate sessions list` reads the served logs.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CACHEGATE_LOG_DIR=/logs

WORKDIR /build
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip install --no-cache-dir . \
    && rm -rf /build

RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin cachegate \
    && mkdir -p /config /logs \
    && chown cachegate:cachegate /logs \
    && chmod 700 /logs

USER cachegate
WORKDIR /logs
VOLUME ["/config", "/logs"]
EXPOSE 8787

# python, not curl: the slim image has no curl. No proxy: an http_proxy the container is given
# (Docker's client `proxies` setting) would send the check elsewhere, and the service would
# never read as healthy.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u; sys.exit(u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:8787/healthz', timeout=4).status != 200)"]

# /config/cachegate.toml is used when it exists (and CACHEGATE_CONFIG is not already set).
CMD ["sh", "-c", "if [ -z \"$CACHEGATE_CONFIG\" ] && [ -f /config/cachegate.toml ]; then export CACHEGATE_CONFIG=/config/cachegate.toml; fi; exec cachegate serve --host 0.0.0.0 --port 8787 --log-dir /logs"]
