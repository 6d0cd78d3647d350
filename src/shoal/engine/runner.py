"""The torch backend: tensors start here.

`TorchBackend` loads a card into a `ModelRunner`, the backend's `LoadedModel` (engine/backend.py):
`forward` takes a padding-free `Batch` and each sequence's spec, runs the encoder once, and lets
each head that some sequence asked for turn the hidden states into per-sequence outputs. Only the
device's lanes call it (engine/device.py), two of them at once on a CPU. `info` is the torch-free
description the tasks, the cache and the device read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..calls import EncodedItem
from ..catalog import ModelCard, resolve_weights
from ..catalog.card import ROW_BLOCK_BYTES
from ..errors import ModelLoadError
from ..head_info import Similarity
from ..heads import BuildContext, Hidden, build_heads
from ..layers import AttentionMeta, PackedInputs, input_maxima, packed, quantize_linears
from ..layers.attention import flash_available
from ..weights import build_model, estimate_bytes
from .backend import LoadedModel, ModelInfo, Preprocessor
from .graphs import Capture, Graphs, cuda_capture, cuda_pool
from .hardware import hardware_class
from .lora import AdapterTable, read_adapter
from .measure import tensor_bytes, workspace_bytes
from .precision import card_for_device, check_quantize
from .streams import LaneStream, LaneStreams
from .threads import lane_threads, lanes_of_this_thread
from .tokenizer import TextTokenizer
from .types import Batch, EncodeSpec, Spec

if TYPE_CHECKING:
    from ..models.idefics3 import Idefics3Config

# Heads that read only the encoder's states: LoRA targets outside the encoder (a pooler, an MLM head)
# are never run under them, so an adapter's tensors for those are dropped rather than refused.
_ENCODER_ONLY_HEADS = frozenset({"dense", "multivector"})


# Extract kinds whose folder wraps the backbone in the library's own layout: the loader
# (module:function, lazily imported) -> (encoder, tokenizer).
_WRAPPED_BACKBONES = {
    "gliner": ".gliner_files:load_gliner_backbone",
    "gliclass": ".gliclass_files:load_gliclass_backbone",
    "gliner2": ".gliner2_files:load_gliner2_backbone",
    "glirel": ".glirel_files:load_glirel_backbone",
}

# Torch's intra-op thread count when shoal started (before any model set its own).
_DEFAULT_THREADS = torch.get_num_threads()

# Batches under this many tokens run on one intra-op thread fewer on a CPU (a card's
# `batching.small_batch_tokens` overrides it; 0: off): on a CPU the HTTP side shares the cores with
# the forward, and a small forward gains least from the extra thread; document-sized batches never
# take it.
SMALL_BATCH_TOKENS = 1024


def _use_default_threads() -> None:
    """Torch's default thread count on the calling (load) thread. A new thread inherits the count
    torch was last given, and each device lane sets it per batch (its share, a thread fewer for
    small ones, a card's `threads: 1`): loads (packing, calibration, adapters) must not run
    single-threaded."""
    if torch.get_num_threads() != _DEFAULT_THREADS:
        torch.set_num_threads(_DEFAULT_THREADS)


class ModelRunner:
    def __init__(
        self,
        card: ModelCard,
        model: torch.nn.Module,
        tokenizer: TextTokenizer,
        device: str,
        directory: Path | None = None,
        max_batch_tokens: int = 16384,
        image: Preprocessor | None = None,
    ) -> None:
        self.card = card
        # Torch intra-op threads for this model's forwards (the card's `batching.threads` for this
        # device, e.g. from `shoal tune`), set on the calling (device) thread; unset: the process default.
        limits = card.batching_for(hardware_class(device))
        self.threads = limits.threads or _DEFAULT_THREADS
        self.attention_each = limits.attention != "padded"  # the CPU attention path (layers/attention.py)
        self.model = model
        self.device = torch.device(device)
        # Smaller batches run on a thread fewer (`Batching.small_batch_tokens`): on a CPU the HTTP side
        # shares the cores with the forward, and a small forward gains least from the extra thread.
        self.small_batch_tokens = (
            limits.small_batch_tokens
            if limits.small_batch_tokens is not None
            else SMALL_BATCH_TOKENS
            if self.device.type == "cpu"
            else 0
        )
        # Feed-forward blocks a block of rows at a time, on a CPU only (layers/rows.py).
        self.row_block_bytes = 0
        if self.device.type == "cpu":
            self.row_block_bytes = ROW_BLOCK_BYTES if limits.row_block_bytes is None else limits.row_block_bytes
        dtype = next(model.parameters()).dtype
        self.heads = build_heads(BuildContext(card, model, directory, tokenizer, dict(device=self.device, dtype=dtype)))
        query = document = None
        for head in self.heads.values():  # late-interaction heads mark queries and documents
            if hasattr(head, "tokenizers"):
                query, document = head.tokenizers()
        # What heads tell the tasks (GLiNER's prompt tokens, label maps, an LLM frame); others say nothing.
        described = tuple(d for head in self.heads.values() if (d := getattr(head, "describe", _nothing)()) is not None)
        if hasattr(model, "logit_scale"):  # a dual encoder scores with its own scale (and bias)
            described += (_similarity(model),)
        self.info = ModelInfo(
            card, tokenizer, tuple(self.heads), query_text=query, document_text=document, heads=described, image=image
        )
        self._adapters = AdapterTable()  # PEFT LoRA adapters by slot (engine/lora.py)
        self._streams = LaneStreams(self.device)  # each lane's stream on a GPU (engine/streams.py)
        self.max_batch_tokens = max_batch_tokens
        self.graphs: Graphs | None = None  # captured forwards per token bucket (engine/graphs.py)
        # Measured, not read off the files: every tensor the model and its heads hold (engine/measure.py).
        self.num_bytes = tensor_bytes([model, *self.heads.values()]) + packed.packed_bytes(model)
        self.workspace_bytes = workspace_bytes(
            model,
            self.heads.values(),
            max_batch_tokens,
            max(tokenizer.max_length, getattr(model, "tokens_per_image", 0)),  # the longest sequence
            self.device,
            flash=flash_available(self.device, dtype),
        )

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.info.text

    def capture_graphs(self, capture: Capture = cuda_capture, new_pool: Callable[[], Any] = cuda_pool) -> Graphs | None:
        """From now on a batch that fits a token bucket runs as that bucket's captured forward
        (engine/graphs.py); `capture` and `new_pool` are CUDA's unless a test hands in its own.
        None: the model is never captured (it reads the device back, `graphable = False`, or it
        pools itself: a dual encoder's `[n, dim]`)."""
        if not getattr(self.model, "graphable", True) or self.card.pooling == "model":
            self.graphs = None
            return None
        self.graphs = Graphs(
            self.model,
            max_length=self.tokenizer.max_length,
            max_tokens=self.max_batch_tokens,
            capture=capture,
            new_pool=new_pool,
        )
        return self.graphs

    @property
    def query_tokenizer(self) -> TextTokenizer:
        return self.info.tokenizer_for(True)

    @property
    def document_tokenizer(self) -> TextTokenizer:
        return self.info.tokenizer_for(False)

    @classmethod
    def load(
        cls,
        card: ModelCard,
        device: str,
        allow_download: bool = True,
        max_batch_tokens: int = 16384,
        pack: bool = True,
        image_limits: tuple[int, int] | None = None,
        *,
        reduced: bool = False,
        graphs: bool = False,
    ) -> ModelRunner:
        directory = resolve_weights(card, allow_download=allow_download)
        return cls.from_dir(
            card,
            directory,
            device,
            allow_download,
            max_batch_tokens,
            pack,
            image_limits,
            reduced=reduced,
            graphs=graphs,
        )

    @classmethod
    def from_dir(
        cls,
        card: ModelCard,
        directory: Path,
        device: str,
        allow_download: bool = True,
        max_batch_tokens: int = 16384,
        pack: bool = True,
        image_limits: tuple[int, int] | None = None,
        *,
        reduced: bool = False,
        graphs: bool = False,
    ) -> ModelRunner:
        """The model in `directory` on `device`, at the precision `card_for_device` chooses there
        (`reduced`: bfloat16 where the card's `precisions` list it and the CPU has it natively);
        `graphs`: on a CUDA device, its forwards replay captured graphs per token bucket
        (engine/graphs.py)."""
        card = card_for_device(card, device, reduced=reduced)
        check_quantize(card, device)
        _use_default_threads()
        wrapped = _WRAPPED_BACKBONES.get(card.extract.kind) if card.extract is not None else None
        if wrapped is not None:
            module, name = wrapped.split(":")
            load_backbone = getattr(importlib.import_module(module, __package__), name)
            model, tokenizer = load_backbone(card, directory, device, allow_download)
        else:
            model = build_model(directory, card.architecture, device, card.dtype)
            # Models with a learned position table cannot take more tokens than it has rows.
            max_length = min(card.max_length, getattr(model, "max_positions", None) or card.max_length)
            tokenizer = TextTokenizer.from_dir(directory, max_length, pad=getattr(model, "pads_texts", False))
        image: Preprocessor | None = None
        if "image" in card.modalities and hasattr(model, "image_token_id"):  # a vision-language model
            image = _tiled_inputs(card, directory, model, tokenizer, image_limits)
        elif "image" in card.modalities:
            from .image_inputs import load_image_inputs  # Pillow: the `image` extra

            if not hasattr(model, "tokens_per_image"):
                raise ModelLoadError(
                    f"model {card.id}: its card reads images, and its {type(model).__name__} has no vision tower",
                    details={"model": card.id},
                )
            vision = model.config.vision
            image = load_image_inputs(
                card,
                directory,
                patch_size=vision.patch_size,
                num_patches=vision.num_patches,
                tokens_per_image=model.tokens_per_image,
                limits=image_limits,
            )
        if card.quantize == "int8":  # the encoder's Linears; embeddings, norms and heads stay float32
            quantize_int8(model, tokenizer)
        elif pack and torch.device(device).type == "cpu" and packed.available():
            packed.pack_linears(model)  # float32 Linears in oneDNN's layout (layers/packed.py)
        runner = cls(card, model, tokenizer, device, directory, max_batch_tokens, image)
        if runner.device.type == "cuda":
            # The lanes' streams do not wait for the loader's copies (engine/streams.py): they are done here.
            torch.cuda.synchronize(runner.device)
            if graphs:
                runner.capture_graphs()
        return runner

    @staticmethod
    def estimate_bytes(
        card: ModelCard, allow_download: bool = True, device: str = "cpu", *, reduced: bool = False
    ) -> int:
        """Before a load: the bytes its checkpoint's tensors take in the dtype it will run in, the
        encoder's Linear weights at one byte each under `quantize: int8` (`card_for_device` chooses
        both; the cache measures the loaded model after)."""
        card = card_for_device(card, device, reduced=reduced)
        directory = resolve_weights(card, allow_download=allow_download)
        # A GLiNER or GLiClass folder's backbone config lives in its own config: counted unquantised (over).
        wrapped = card.extract is not None and card.extract.kind in _WRAPPED_BACKBONES
        return estimate_bytes(
            directory, card.dtype, quantize=None if wrapped else card.quantize, architecture=card.architecture
        )

    def add_adapter(self, name: str, directory: Path) -> int:
        """Load the PEFT LoRA adapter in `directory` onto this model (tensors on its device, in its
        dtype) and install it under `name`; returns its slot, stable while it is installed.

        Safe from a loader thread while the device thread runs `forward`: everything is built off to
        the side and installed in one swap, so a forward sees the adapter whole or not at all.
        """
        _use_default_threads()
        dtype = next(self.model.parameters()).dtype
        adapter = read_adapter(
            name,
            directory,
            self.model,
            device=self.device,
            dtype=dtype,
            drop_head_targets=set(self.heads) <= _ENCODER_ONLY_HEADS,
        )
        if self.device.type == "cuda":  # the copies are complete before any forward can read them
            torch.cuda.synchronize(self.device)
        return self._adapters.install(adapter)

    def remove_adapter(self, name: str) -> None:
        """Uninstall `name` (the caller guarantees no queued or running batch uses it); its slot is
        free for the next adapter."""
        self._adapters.remove(name)

    def adapter_slot(self, name: str) -> int | None:
        return self._adapters.slot(name)

    def adapter_bytes(self, name: str) -> int:
        """Bytes the installed adapter's tensors take on the device (measured)."""
        return self._adapters.get(name).num_bytes

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return self._adapters.names

    def threads_for(self, num_tokens: int) -> int:
        """Torch intra-op threads for a forward of `num_tokens` tokens on the calling thread (a
        device lane takes its share of them)."""
        threads = lane_threads(self.threads, lanes_of_this_thread())
        return max(1, threads - 1) if num_tokens < self.small_batch_tokens else threads

    @torch.inference_mode()
    def forward(self, batch: Batch, specs: Sequence[Spec]) -> list[object]:
        # Per thread (OpenMP): the device thread's count; threads it starts later inherit it (loads
        # reset it, see from_dir).
        threads = self.threads_for(batch.num_tokens)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        lane = self._streams.current()  # the lane's own stream on a GPU (engine/streams.py)
        with lane.running():
            return self._forward(batch, specs, lane)

    def _forward(self, batch: Batch, specs: Sequence[Spec], lane: LaneStream) -> list[object]:
        input_ids = lane.stage(batch.input_ids)  # [T]
        position_ids = lane.stage(batch.position_ids)  # [T]
        cu_seqlens = lane.stage(batch.cu_seqlens)  # [n+1]
        key_lengths = None if batch.key_lengths is None else lane.stage(batch.key_lengths)  # [n]
        token_type_ids = None if batch.token_type_ids is None else lane.stage(batch.token_type_ids)
        routing = (
            None
            if batch.adapter_slots is None
            else self._adapters.routing(batch.cu_seqlens, batch.adapter_slots, self.device)
        )
        # Never in row blocks under LoRA: its hooks route a Linear's rows by batch position (layers/rows.py).
        meta = AttentionMeta.build(
            cu_seqlens,
            batch.max_seqlen,
            key_lengths,
            each=self.attention_each,
            row_block_bytes=self.row_block_bytes if routing is None else 0,
            host_cu_seqlens=batch.cu_seqlens,
        )
        inputs = PackedInputs(input_ids, position_ids, meta, token_type_ids, _features(batch, lane))
        # A bucket's captured forward when the model has them and the batch fits one (engine/graphs.py).
        states = None if routing is not None or self.graphs is None else self.graphs.forward(batch, lane)
        if states is None and routing is None:
            states = self.model(inputs)  # [T, hidden]
        elif states is None:  # each sequence's tokens get its adapter's deltas (layers/lora.py)
            assert routing is not None
            with routing.applied(self.model):
                states = self.model(inputs)  # [T, hidden]
        hidden = Hidden(states, input_ids, meta)

        wanted = {name for spec in specs for name in spec.outputs}
        per_head = {name: head.run(hidden, specs) for name, head in self.heads.items() if name in wanted}
        none = [None] * len(specs)
        if "token_states" in wanted:  # the encoder's own states, per sequence (TEI's /embed_all)
            states_np = states.float().cpu().numpy()
            cu = batch.cu_seqlens
            per_head["token_states"] = [
                states_np[cu[i] : cu[i + 1]].copy() if "token_states" in spec.outputs else None
                for i, spec in enumerate(specs)
            ]
        return [
            EncodedItem(
                dense=per_head.get("dense", none)[i],
                sparse=per_head.get("sparse", none)[i],
                multivector=per_head.get("multivector", none)[i],
                token_states=per_head.get("token_states", none)[i],
            )
            if isinstance(spec, EncodeSpec)
            else per_head[spec.outputs[0]][i]
            for i, spec in enumerate(specs)
        ]

    def close(self) -> None:
        """Called on eviction. A batch already running keeps its reference until it finishes."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class TorchBackend:
    """The `Backend` (engine/backend.py) that runs shoal's own PyTorch forwards on `device`."""

    name = "torch"

    def __init__(
        self,
        device: str,
        *,
        allow_download: bool = True,
        max_batch_tokens: int = 16384,
        max_batch_tokens_of: Callable[[ModelCard], int] | None = None,
        pack: bool = True,
        image_limits: tuple[int, int] | None = None,
        reduced_precision: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        self.device = device
        self.reduced_precision = reduced_precision  # engine/precision.py: bfloat16 where the card allows
        self.cuda_graphs = cuda_graphs  # engine/graphs.py: captured forwards per token bucket on CUDA
        self.image_limits = image_limits  # (bytes, pixels) of a client's image file; None: image_inputs' defaults
        self.allow_download = allow_download
        self._max_batch_tokens = max_batch_tokens
        self._max_batch_tokens_of = max_batch_tokens_of
        self.pack = pack

    def load(self, card: ModelCard) -> LoadedModel:
        if card.generate is not None:  # a decoder that generates: its own loop (engine/generation.py)
            from .generation import GeneratingModel

            chosen = card_for_device(card, self.device, reduced=self.reduced_precision)
            _use_default_threads()
            directory = resolve_weights(chosen, allow_download=self.allow_download)
            return GeneratingModel(chosen, directory, self.device, _DEFAULT_THREADS, pack=self.pack)
        max_batch_tokens = self._max_batch_tokens_of(card) if self._max_batch_tokens_of else self._max_batch_tokens
        return ModelRunner.load(
            card,
            self.device,
            self.allow_download,
            max_batch_tokens,
            self.pack,
            self.image_limits,
            reduced=self.reduced_precision,
        )

    def estimate_bytes(self, card: ModelCard) -> int:
        weights = ModelRunner.estimate_bytes(card, self.allow_download, self.device, reduced=self.reduced_precision)
        if card.generate is None:
            return weights
        from ..weights import read_config

        config = read_config(resolve_weights(card, allow_download=self.allow_download))
        heads = config.get("num_attention_heads", 1)
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(1, heads)
        position = 2 * config.get("num_hidden_layers", 0) * config.get("num_key_value_heads", heads) * head_dim
        itemsize = 4 if card.dtype == "float32" else 2
        positions = card.generate.cache_positions or card.generate.slots * card.max_length
        return weights + positions * position * itemsize  # the KV cache


def _similarity(model: torch.nn.Module) -> Similarity:
    """A dual encoder's score: CLIP's scaled cosine, SigLIP's sigmoid of it plus a bias."""
    scale, bias = model.get_parameter("logit_scale"), getattr(model, "logit_bias", None)
    return Similarity(
        scale=float(scale.exp()),
        bias=0.0 if bias is None else float(bias),
        sigmoid=bias is not None,
    )


def _nothing() -> None:
    return None


def _features(batch: Batch, lane: LaneStream) -> dict[str, torch.Tensor]:
    """The batch's feature slots on the device: `name` -> its rows `[R, ...]`, and
    `name + "_cu_rows"` -> `[n+1]` each sequence's first row (PackedInputs.features)."""
    out = {}
    for name, slot in batch.features.items():
        out[name] = lane.stage(slot.values)
        out[f"{name}_cu_rows"] = lane.stage(slot.cu_rows)
    return out


# What the float32 model reads once before `quantize: int8`, to find each Linear's outlier input
# channels (layers/int8.py): which channels carry huge activations is the model's, not the text's.
_CALIBRATION_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What time does the last train to the airport leave on Sundays?",
    "Shares fell 3.2% on Tuesday after the company cut its forecast for 2024, citing weak demand in Europe and Asia.",
    "rain",
    "How do I reset my password?",
    "Researchers at the university said the new vaccine was safe and produced a strong immune response in a trial "
    "of 1,200 volunteers, though larger studies are needed before it can be approved.",
    "Add two cups of flour, one egg and a pinch of salt; stir until smooth.",
    "Paris, France",
)


def quantize_int8(model: torch.nn.Module, tokenizer: TextTokenizer) -> None:
    """Swap the model's Linears for int8 ones, outlier channels as the calibration texts show them
    (the model's own packed forward reads them; a generating model's too, engine/generation.py)."""
    batch = Batch.pack(tokenizer.encode(list(_CALIBRATION_TEXTS), truncate=True))
    input_ids, position_ids = torch.from_numpy(batch.input_ids), torch.from_numpy(batch.position_ids)  # [T]
    meta = AttentionMeta.build(torch.from_numpy(batch.cu_seqlens), batch.max_seqlen)
    inputs = PackedInputs(input_ids, position_ids, meta)
    quantize_linears(model, input_maxima(model, lambda: model(inputs)))


def _tiled_inputs(
    card: ModelCard, directory: Path, model: torch.nn.Module, tokenizer: TextTokenizer, limits: tuple[int, int] | None
) -> Preprocessor:
    """The page-image preprocessor of a vision-language model (Idefics3): tiles, and the card's
    image prompt expanded to the tiles' `<image>` tokens; a ModelLoadError names what disagrees."""
    from .tiled_images import load_tiled_inputs  # Pillow: the `image` extra

    config = cast("Idefics3Config", model.config)
    if card.image_prompt is None:
        raise ModelLoadError(
            f"model {card.id}: a vision-language model's card needs image_prompt (its text around an image)",
            details={"model": card.id},
        )
    inputs = load_tiled_inputs(
        card,
        directory,
        tokenizer=tokenizer,
        patch_size=config.vision.patch_size,
        tile_size=config.vision.image_size,
        image_token_id=config.image_token_id,
        prompt=card.image_prompt,
        limits=limits,
    )
    if inputs.image_seq_len != config.image_seq_len:
        raise ModelLoadError(
            f"model {card.id}: its processor puts {inputs.image_seq_len} <image> tokens per tile; the model "
            f"makes {config.image_seq_len}",
            details={"model": card.id},
        )
    return inputs
