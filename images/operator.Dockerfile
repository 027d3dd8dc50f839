# The operator image: `conveyor operator` with conveyor[operator] only (kopf, the Kubernetes client;
# no torch), as a non-root user. Build from the repository root:
#   make images                                   (buildah, podman or docker; tags ...:VERSION)
#   docker build -f images/operator.Dockerfile -t conveyor-operator .
# BASE is any Debian-like image; one without Python gets Debian's python3 (hack/images/build.sh builds
# on a debootstrap base where no registry is reachable).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
# Set only by hack/images/build.sh behind a TLS-inspecting proxy: the host's CA bundle, mounted for RUN.
ARG PIP_CERT

RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin; \
    fi \
    && (getent passwd 10001 || useradd --uid 10001 --user-group --create-home --home-dir /home/conveyor conveyor)

# The dependencies first, from pyproject.toml alone: a layer a rebuild reuses until the pins change.
COPY pyproject.toml /src/
RUN python3 -m venv /opt/conveyor \
    && python3 -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["operator"]))' > /src/requirements.txt \
    && /opt/conveyor/bin/pip install --no-cache-dir --disable-pip-version-check -r /src/requirements.txt
COPY README.md /src/
COPY server /src/server
COPY kernels /src/kernels
COPY operator /src/operator
COPY benchmarks /src/benchmarks
RUN /opt/conveyor/bin/pip install --no-cache-dir --disable-pip-version-check --no-deps /src && rm -rf /src

ENV PATH=/opt/conveyor/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1
USER 10001:10001
WORKDIR /home/conveyor
ENTRYPOINT ["conveyor"]
CMD ["operator", "--help"]
