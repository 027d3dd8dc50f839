#!/usr/bin/env bash
# Download, on a machine that reaches PyPI, the wheels `hack/gpu-check/run.sh` installs on a GPU
# machine without network whose Python 3.12 already has torch, triton and transformers (and their
# dependencies: numpy, pyyaml, tqdm, huggingface_hub, safetensors, tokenizers) but not the rest of
# the server's. Versions are the pins in pyproject.toml; torch, triton, transformers, numpy and ninja
# are left to the machine. Output: .gpu-check/wheels/ (git-ignored), about 20 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PYVER=${GPU_CHECK_PYTHON_VERSION:-3.12}
dest=.gpu-check/wheels
rm -rf "$dest" && mkdir -p "$dest"
# Pins from pyproject.toml: the base and server dependencies and the test runner.
mapfile -t with_deps < <("$PY" - <<'PYEOF'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
test_runner = [d for d in extras["dev"] if d.startswith(("pytest==", "pytest-timeout=="))]
provided = ("torch", "triton", "transformers", "numpy", "ninja", "gguf", "accelerate")
for dep in project["dependencies"] + extras["server"] + test_runner:
    if not dep.split("=")[0].split(">")[0].strip().startswith(provided):
        print(dep)
PYEOF
)
mapfile -t no_deps < <("$PY" - <<'PYEOF'
import tomllib

extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
# Their dependencies besides psutil come with transformers; accelerate's would pull in torch.
for dep in extras["server"]:
    if dep.startswith(("gguf==", "accelerate==")):
        print(dep)
print("psutil")
PYEOF
)
platform=(--only-binary=:all: --python-version "$PYVER" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q -d "$dest" "${platform[@]}" "${with_deps[@]}" "setuptools>=75" wheel
"$PY" -m pip download -q -d "$dest" "${platform[@]}" --no-deps "${no_deps[@]}"
printf '%s\n' "${with_deps[@]}" > "$dest/with-deps.txt"
printf '%s\n' "${no_deps[@]}" > "$dest/no-deps.txt"
du -sh "$dest"
