"""Random-initialised backbones and PEFT LoRA adapters on them, saved as transformers and peft save
them, with the card and padded reference runs the LoRA tests compare shoal against. Shared by
tests/test_lora.py and bench/lora_forward.py.

Each backbone folder gets MiniLM's tokenizer.json only so that `ModelRunner.from_dir` finds a
tokenizer: the tests pack their own random ids.

Imported as `lora_models`: pytest's default (prepend) import mode puts tests/ on sys.path.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import peft
import torch
import transformers
import yaml
from transformers.initialization import no_init_weights

from parity import randomize_norms, randomize_parameters
from rerankers import minilm_dir
from shoal.catalog import ModelCard, parse_card
from shoal.engine.tokenizer import Encoded
from shoal.engine.types import Batch, EncodeSpec

VOCAB = 1000


@dataclass(frozen=True)
class Backbone:
    """One transformers architecture as the LoRA tests build it."""

    config_class: type
    model_class: type
    shape: dict[str, Any]
    targets: tuple[str, ...]  # PEFT target_modules: attention and MLP projections
    first_id: int = 1  # ids below are special (the pad id among them)
    pad_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # config keys besides the shape


BACKBONES = {
    # "dense" also hits the pooler's Linear, which an embedder never runs: shoal drops it.
    "bert": Backbone(
        transformers.BertConfig,
        transformers.BertModel,
        dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128),
        ("query", "key", "value", "dense"),
        extra=dict(max_position_embeddings=128),
    ),
    "xlm-roberta": Backbone(
        transformers.XLMRobertaConfig,
        transformers.XLMRobertaModel,
        dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=96),
        ("query", "value", "attention.output.dense", "intermediate.dense", "output.dense"),
        first_id=2,
        pad_id=1,
        extra=dict(max_position_embeddings=130, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1),
    ),
    "modernbert": Backbone(
        transformers.ModernBertConfig,
        transformers.ModernBertModel,
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            hidden_size=64,
            intermediate_size=96,
            global_attn_every_n_layers=2,
            local_attention=16,
        ),
        ("Wqkv", "Wo", "Wi"),
        first_id=3,
        extra=dict(
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2
        ),
    ),
    "qwen3": Backbone(
        transformers.Qwen3Config,
        transformers.Qwen3Model,
        dict(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=64,
            head_dim=32,
            intermediate_size=128,
        ),
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        first_id=0,
    ),
    # transformers' port of NomicBERT renames nomic's modules (q_proj... down_proj for Wqkv, fc11...).
    "nomic_bert": Backbone(
        transformers.NomicBertConfig,
        transformers.NomicBertModel,
        dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128),
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        extra=dict(max_position_embeddings=128),
    ),
    # transformers' DistilBERT and MPNet name their projections their own way (q_lin... lin2; q, k, v, o).
    "distilbert": Backbone(
        transformers.DistilBertConfig,
        transformers.DistilBertModel,
        dict(n_layers=2, n_heads=4, dim=64, hidden_dim=128),
        ("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"),
        extra=dict(max_position_embeddings=128),
    ),
    "mpnet": Backbone(
        transformers.MPNetConfig,
        transformers.MPNetModel,
        dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128),
        ("q", "k", "v", "o", "intermediate.dense", "output.dense"),
        first_id=2,
        pad_id=1,
        extra=dict(max_position_embeddings=130, pad_token_id=1, bos_token_id=0, eos_token_id=2),
    ),
    # DeBERTa-v3's attention (shared q/k position projections): adapters may not target q/k/v there.
    "deberta-v2": Backbone(
        transformers.DebertaV2Config,
        transformers.DebertaV2Model,
        dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128),
        ("output.dense", "intermediate.dense"),
        extra=dict(
            relative_attention=True,
            position_buckets=32,
            max_relative_positions=-1,
            max_position_embeddings=512,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            type_vocab_size=0,
        ),
    ),
}


def save_backbone(directory: Path, name: str) -> torch.nn.Module:
    """A seeded random `name` backbone saved to `directory` (with a tokenizer); returns it, in eval
    mode with eager attention."""
    spec = BACKBONES[name]
    torch.manual_seed(0)
    config = spec.config_class(vocab_size=VOCAB, **spec.extra, **spec.shape)
    with no_init_weights():  # transformers' init is slow on CPU, and every tensor is drawn below
        reference = spec.model_class(config).eval()
    reference.set_attn_implementation("eager")
    randomize_parameters(reference)
    randomize_norms(reference, 0.1, all_biases=True)
    reference.save_pretrained(directory)
    shutil.copy(minilm_dir() / "tokenizer.json", directory / "tokenizer.json")
    return reference


def save_adapter(
    reference: torch.nn.Module, directory: Path, seed: int, *, safe_serialization: bool = True, **lora: Any
) -> peft.PeftModel:
    """A LoRA adapter with seeded random A and B (non-zero, so it changes outputs) on a copy of
    `reference`, saved to `directory`; returns the unmerged PEFT model, in eval mode."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora)
    model = peft.get_peft_model(copy.deepcopy(reference), config).eval()
    with torch.no_grad():  # B ~ N(0, 1/r) and A ~ N(0, 1/in): deltas the size of the base projections
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.normal_(0.0, param.shape[1] ** -0.5)
    model.save_pretrained(directory, safe_serialization=safe_serialization)
    return model


def card(name: str, directory: Path, pooling: str = "mean") -> ModelCard:
    """An encode card for the backbone in `directory`: un-normalised `pooling` vectors."""
    spec = BACKBONES[name]
    architecture = {"xlm-roberta": "xlm-roberta"}.get(name, name)
    dimensions = spec.shape.get("hidden_size", spec.shape.get("dim"))  # DistilBERT calls it dim
    text = (
        f"id: test/{name}\narchitecture: {architecture}\nsource: {{path: {directory}}}\nmax_length: 128\n"
        f"tasks: [encode]\npooling: {pooling}\nnormalize: false\ndimensions: {dimensions}\n"
    )
    return parse_card(yaml.safe_load(text), f"{name}.yaml")


def random_sequences(name: str, lengths: list[int], seed: int = 1) -> list[np.ndarray]:
    """One sequence of random ids (above the backbone's special ids) per length."""
    rng = np.random.default_rng(seed)
    return [rng.integers(BACKBONES[name].first_id, VOCAB, n).astype(np.int64) for n in lengths]


def runner_vectors(runner, seqs: list[np.ndarray], slots: list[int] | None) -> np.ndarray:
    """The runner's pooled vectors `[n, hidden]` for `seqs` packed in one batch, sequence i under
    adapter slot `slots[i]` (-1: the base model; None: no adapters at all)."""
    batch = Batch.pack([Encoded(ids) for ids in seqs], adapter_slots=slots)
    spec = EncodeSpec(normalize=False, dimensions=None, output_dtype="float32")
    return np.stack([item.dense for item in runner.forward(batch, [spec] * len(seqs))])


def reference_outputs(model: torch.nn.Module, name: str, seqs: list[np.ndarray]) -> list[torch.Tensor]:
    """`model` (transformers or PEFT) on `seqs` right-padded with the pad id and an attention mask:
    one `[n_i, hidden]` tensor of real tokens per sequence."""
    ids = [torch.from_numpy(s) for s in seqs]
    padded = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=BACKBONES[name].pad_id)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in ids], batch_first=True)
    with torch.no_grad():
        out = model(input_ids=padded, attention_mask=mask).last_hidden_state  # [B, L, hidden]
    return [out[i, : len(s)] for i, s in enumerate(seqs)]
