"""RoBERTa and XLM-RoBERTa (the multilingual E5, BGE-M3 and DistilRoBERTa embedders built on them).

The encoder is BERT's, tensor for tensor; only two things differ, and only they live here:
positions are numbered fairseq-style, starting after the padding index (`pad_token_id + 1` for a
sequence's first token), and checkpoints put the encoder under `roberta.`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..layers import PackedInputs
from .bert import BertConfig, BertModel


@dataclass(frozen=True)
class RobertaConfig(BertConfig):
    # fairseq reserves position ids 0..pad_token_id; real tokens start at pad_token_id + 1.
    pad_token_id: int = 1


class RobertaModel(BertModel):
    config_class = RobertaConfig
    checkpoint_prefixes = ("roberta.", "model.")
    # Same tensor names as BERT; a masked-LM checkpoint adds `lm_head.*`, which serving does not use.
    ignored_weights = [*BertModel.ignored_weights, r"lm_head\..*"]

    config: RobertaConfig

    @staticmethod
    def classifier_layout(config: dict) -> tuple[str, list[tuple]]:
        """RobertaClassificationHead: dense + tanh on <s>, then out_proj (no pooler)."""
        return "cls", [("linear", "classifier.dense"), ("act", "tanh"), ("linear", "classifier.out_proj")]

    @property
    def max_positions(self) -> int:  # ids 0..pad are reserved, so 514 positions hold 512 tokens
        return self.config.max_position_embeddings - self.config.pad_token_id - 1

    def forward(self, inputs: PackedInputs) -> torch.Tensor:
        # transformers' create_position_ids_from_input_ids on an unpadded sequence: pad + 1 + index.
        offset_positions = inputs.position_ids + (self.config.pad_token_id + 1)  # [T]
        # RoBERTa tokenizers feed no segment ids (a pair is all segment 0; the table has one row).
        return super().forward(replace(inputs, position_ids=offset_positions, token_type_ids=None))  # [T, hidden]
