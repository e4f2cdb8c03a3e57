# The kevlaya worker image: CUDA runtime, the `worker` extra, a non-root user, healthy once /readyz says so.
# Build: docker build -t kevlaya-worker .   (needs Docker Hub and PyPI; this project's CI cannot reach the
# former, so it lints this file with hadolint and validates compose.yaml instead of building).
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TOKENIZERS_PARALLELISM=false

# gcc and Python's headers: Triton builds its launcher at the first kernel (torch.compile's fused steps and our
# own kernels); without them both fall back to slower eager code, with a traceback at every start.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev python3-pip gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/kevlaya

ENV PATH=/opt/kevlaya/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY producer ./producer
COPY worker ./worker
RUN pip install --no-cache-dir '.[worker]' \
    && useradd --create-home --uid 10001 kevlaya
USER 10001
WORKDIR /home/kevlaya

EXPOSE 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python3", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9100/readyz', timeout=4).status != 200)"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["kevlaya"]
CMD ["worker", "--config", "/models/models.toml", "--metrics-port", "9100"]
