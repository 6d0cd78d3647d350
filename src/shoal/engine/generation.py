"""Generating models: a decoder, its KV cache and its generation loop, beside the device's batches.

    TorchBackend.load(card with a `generate` block) ─▶ GeneratingModel (a LoadedModel)
        .info          the tokenizer, and a ChatFrame head (chat template, end-of-sequence ids)
        .generation    GenerationLoop: one thread per model that runs shoal.generate's Generator
                       step after step while any sequence runs, and sleeps otherwise

    engine ─ submit(prompt ids, GenerateSpec, grammar, on_update) ─▶ waiting (FIFO)
           ─ a free KV cache slot ─▶ the Generator (prefill packed, then one token a step)
           ◀ on_update(Generated) after each step that gave it tokens, and once when it ends
           ─ cancel(entry): the client went away; it leaves before the next step, its slot freed

A call never takes a device lane for its whole generation: encoder batches keep the lanes, and a
generation's steps run on the model's own thread (on a CPU the two share the cores). Calls beyond
the cache's slots wait in arrival order (their deadline still runs) rather than fail, unless the
wait for a slot would be longer than the caller may wait (`submit`'s `max_wait_s`): then they are
refused at once (503, Retry-After) rather than answered 504 at their deadline. The wait is
estimated from the sequences running and waiting ahead, each holding its slot and its cache
positions for its max_new_tokens or the typical answer's length, whichever is shorter (one already
past that length: as long again as it has run), at the recent step time; a sequence starts once a
slot and the positions it needs are both free (a paged cache can have the one without the other).
Constraints are compiled by `compile` off the loop (the engine calls it on a worker thread).
"""

from __future__ import annotations

import collections.abc
import heapq
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..calls import Generated
from ..catalog import ModelCard
from ..errors import ConfigError, InvalidRequest, ModelLoadError, Overloaded, ShoalError
from ..generate.batcher import GenerationRequest, Generator, Sequence
from ..generate.forward import CachedDecoder, lm_head_of
from ..generate.kv_cache import PagedCache
from ..head_info import ChatFrame
from ..layers import int4, packed
from ..models.llama import LlamaModel
from ..weights import build_model
from .backend import ModelInfo
from .measure import tensor_bytes
from .precision import check_quantize
from .tokenizer import TextTokenizer
from .tokenizer_files import load_tokenizer
from .types import Batch, GenerateSpec, Spec

log = logging.getLogger("shoal.engine.generation")

OnUpdate = Callable[[Generated, BaseException | None], None]
# Positions per KV cache block: a sequence reserves whole blocks for its prompt and max_new_tokens.
BLOCK_SIZE = 64
# The weight of the newest step (answer) in the loop's moving average of step times (answer lengths).
_SMOOTHING = 0.2


@dataclass(eq=False)
class Entry:
    """One submitted sequence, from the loop's side."""

    request: GenerationRequest
    on_update: OnUpdate
    streams: bool  # decode its text after every step (else once, when it ends)
    seq: Sequence | None = None
    cancelled: bool = False
    sent: int = 0  # tokens already reported
    first_token_at: float | None = None
    done: bool = field(default=False)


class GenerationLoop:
    """The model's generation thread (see the module docstring)."""

    def __init__(self, generator: Generator, threads: int, name: str) -> None:
        self.generator = generator
        self.threads = threads
        self._cond = threading.Condition()
        self._inbox: list[Entry] = []
        self._waiting: deque[Entry] = deque()
        self._running: dict[int, Entry] = {}  # id(seq) -> entry
        self._closed = False
        # Recent seconds per step and tokens per finished answer (moving averages), for `wait_s`.
        self._step_s: float | None = None
        self._answer_tokens: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"shoal-generate-{name}", daemon=True)
        self._thread.start()

    # --- the engine's side (any thread) ----------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.generator.cache.slots

    @property
    def in_use(self) -> int:
        """KV cache slots held by running sequences."""
        return self.generator.cache.in_use

    @property
    def free_positions(self) -> int:
        """KV cache positions no sequence holds."""
        return self.generator.cache.free_positions

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._inbox) + len(self._waiting)

    def submit(
        self,
        prompt_ids: list[int],
        spec: GenerateSpec,
        grammar: str | None,
        on_update: OnUpdate,
        *,
        deadline: float,
        max_wait_s: float = math.inf,
        streams: bool = False,
    ) -> Entry:
        """Queue a sequence for a slot; Overloaded if its wait for one would pass `max_wait_s`."""
        request = GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            seed=spec.seed,
            stop=spec.stop,
            deadline=deadline,
            grammar=grammar,
        )
        self.generator.cache.check(len(prompt_ids) + spec.max_new_tokens)
        entry = Entry(request, on_update, streams)
        with self._cond:
            if self._closed:
                raise Overloaded("the model is being unloaded; retry", retry_after_s=1.0)
            wait_s = self._wait_s(len(prompt_ids) + spec.max_new_tokens)
            if wait_s is not None and wait_s > max_wait_s:
                ahead = len(self._inbox) + len(self._waiting)
                retry_after_s = float(max(1, math.ceil(wait_s - max_wait_s)))
                raise Overloaded(
                    f"the model's {self.slots} KV cache slots are taken and {ahead} generations wait for one: "
                    f"this one would wait about {wait_s:.0f} s, more than {max_wait_s:.0f} s; retry in "
                    f"{retry_after_s:.0f} s",
                    retry_after_s=retry_after_s,
                    details={"waiting": ahead, "slots": self.slots, "estimated_wait_s": round(wait_s, 1)},
                )
            self._inbox.append(entry)
            self._cond.notify()
        return entry

    def _wait_s(self, length: int) -> float | None:
        """Seconds until a sequence of `length` positions submitted now gets a slot and the cache
        positions it needs (call under the lock; see the module docstring); None until a step has
        been timed."""
        if self._step_s is None:
            return None
        typical = self._answer_tokens or math.inf
        cache = self.generator.cache
        # Copies (atomic under the GIL): the loop's thread changes these without the lock.
        running = [entry.seq for entry in tuple(self._running.values()) if entry.seq is not None]
        slots, positions = max(0, self.slots - len(running)), cache.free_positions
        # (steps from now, positions freed) per running sequence; one already past the typical
        # length is expected to run as long again.
        releases = [
            (
                max(1.0, min(seq.request.max_new_tokens, max(typical, 2 * len(seq.tokens))) - len(seq.tokens)),
                cache.held(seq.slot),
            )
            for seq in running
        ]
        heapq.heapify(releases)
        # Those ahead start in arrival order (none overtakes), each once a slot and its positions are free.
        ahead = [
            (len(e.request.prompt_ids) + e.request.max_new_tokens, e.request.max_new_tokens)
            for e in (*tuple(self._waiting), *self._inbox)
        ]
        now = 0.0
        for need, new_tokens in (*ahead, (length, 0)):
            held = cache.positions_for(need)
            while slots < 1 or positions < held:
                if not releases:
                    return None  # nothing will free what it needs (cache.check refuses what never fits)
                at, freed = heapq.heappop(releases)
                now, slots, positions = max(now, at), slots + 1, positions + freed
            slots, positions = slots - 1, positions - held
            heapq.heappush(releases, (now + min(new_tokens, typical), held))
        return now * self._step_s

    def cancel(self, entry: Entry) -> None:
        """The sequence stops before the next step; its slot is freed then."""
        entry.cancelled = True
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        """Ends the loop after its current step (not waited for here: the cache calls this on the
        event loop); what still runs or waits ends with an Overloaded error."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not (self._inbox or self._waiting or self._running)

    # --- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                while not (self._closed or self._inbox or self._waiting or self.generator.running):
                    self._cond.wait()
                if self._closed:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            try:
                self._turn()
            except Exception as exc:  # a bug of the loop's own: its sequences end, the loop goes on
                log.exception("the generation loop failed")
                self._fail_running(ShoalError(f"generation failed: {type(exc).__name__}"))
        self._shut_down()

    def _turn(self) -> None:
        """Admit what fits, run a step, report it."""
        generator = self.generator
        self._admit()
        for entry in self._running.values():
            if entry.cancelled and entry.seq is not None:
                generator.cancel(entry.seq)
        if not generator.running:
            return
        try:
            started = time.perf_counter()
            generator.step()
            took = time.perf_counter() - started
            self._step_s = took if self._step_s is None else (1 - _SMOOTHING) * self._step_s + _SMOOTHING * took
        except Exception as exc:  # a failed step ends its sequences with "error" (batcher)
            log.exception("a generation step failed")
            error = exc if isinstance(exc, ShoalError) else ShoalError(f"generation failed: {type(exc).__name__}")
            self._report(error)
            return
        self._report(None)

    def _fail_running(self, error: ShoalError) -> None:
        for seq in list(self.generator.running):  # those added but not yet registered too
            self.generator.cancel(seq)
        for entry in list(self._running.values()):
            self._finish(entry, Generated([], "", "error"), error)
        self._running.clear()
        try:
            self.generator.step()  # retires the cancelled sequences and frees their blocks
        except Exception:
            log.exception("retiring the failed sequences failed")

    def _admit(self) -> None:
        now = time.monotonic()
        cache = self.generator.cache
        kept: deque[Entry] = deque()
        while self._waiting:
            entry = self._waiting.popleft()
            if entry.cancelled or now > entry.request.deadline:
                self._finish(entry, Generated([], "", "cancelled" if entry.cancelled else "deadline"), None)
                continue
            length = len(entry.request.prompt_ids) + entry.request.max_new_tokens
            if kept or not cache.fits(length):  # in arrival order: none overtakes a waiting one
                kept.append(entry)
                continue
            try:
                entry.seq = self.generator.add(entry.request)
            except ShoalError as exc:
                self._finish(entry, Generated([], "", "error"), exc)
                continue
            self._running[id(entry.seq)] = entry
        self._waiting = kept

    def _report(self, error: BaseException | None) -> None:
        """Each running entry's new tokens; the ended ones leave."""
        now = time.monotonic()
        for key, entry in list(self._running.items()):
            seq = entry.seq
            assert seq is not None
            if seq.tokens and entry.first_token_at is None:
                entry.first_token_at = now
            if seq.done:
                del self._running[key]
                if seq.finish_reason in ("stop", "length"):
                    n = len(seq.tokens)
                    typical = self._answer_tokens
                    self._answer_tokens = n if typical is None else (1 - _SMOOTHING) * typical + _SMOOTHING * n
                failed = error if seq.finish_reason == "error" else None
                self._finish(entry, self._generated(entry), failed)
            elif entry.streams and not entry.cancelled and len(seq.tokens) > entry.sent:
                entry.sent = len(seq.tokens)
                try:
                    entry.on_update(self._generated(entry), None)
                except Exception:  # the caller's callback (its event loop gone): it is cancelled
                    log.exception("a generation callback failed")
                    entry.cancelled = True

    def _generated(self, entry: Entry) -> Generated:
        seq = entry.seq
        assert seq is not None
        decode = self.generator.decode
        text = seq.text if seq.text is not None else decode(seq.tokens) if decode is not None else ""
        return Generated(list(seq.tokens), text, seq.finish_reason, entry.first_token_at)

    def _finish(self, entry: Entry, generated: Generated, error: BaseException | None) -> None:
        entry.done = True
        try:
            entry.on_update(generated, error)
        except Exception:  # the caller's callback: never the loop's end
            log.exception("a generation callback failed")

    def _shut_down(self) -> None:
        gone = Overloaded("the model was unloaded during the generation; retry", retry_after_s=1.0)
        with self._cond:
            pending = list(self._inbox) + list(self._waiting)
            self._inbox.clear()
            self._waiting.clear()
        for entry in list(self._running.values()) + pending:
            if entry.seq is not None and not entry.seq.done:
                self.generator.cancel(entry.seq)
            self._finish(entry, Generated([], "", "error"), gone)
        self._running.clear()


class GeneratingModel:
    """A decoder loaded to generate: the backend's LoadedModel for cards with a `generate` block."""

    def __init__(self, card: ModelCard, directory: Path, device: str, threads: int, *, pack: bool = True) -> None:
        if card.generate is None:
            raise ConfigError(f"model {card.id}: its card has no generate block")
        check_quantize(card, device)  # CPUs only, float32 activations
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[card.dtype]
        model = build_model(directory, card.architecture, device, card.dtype)
        if not isinstance(model, LlamaModel):
            raise ModelLoadError(
                f"model {card.id}: generation runs on Llama-family decoders, not {type(model).__name__}",
                details={"model": card.id},
            )
        config = model.config
        tokenizer = TextTokenizer.from_dir(directory, card.max_length)
        frame = chat_frame(directory, tokenizer)
        cache = PagedCache(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            slots=card.generate.slots,
            max_len=card.max_length,
            positions=card.generate.cache_positions,
            block_size=BLOCK_SIZE,
            dtype=dtype,
            device=device,
        )
        # oneDNN's packed layout for every Linear and the LM head (layers/packed.py), as the engine
        # packs encoders on a CPU: 1.3-1.6x the decode steps' tokens/s here (docs/benchmarks.md).
        packing = pack and torch.device(device).type == "cpu" and dtype == torch.float32 and packed.available()
        if card.quantize == "int8":
            # The Linears int8 as an encoder's (outlier channels from the float32 model's read of the
            # calibration texts), the LM head float32: not token for token float32's answers, which
            # the card says (docs/generate.md has how far they agree, and the speed).
            from .runner import quantize_int8

            quantize_int8(model, tokenizer)
        elif card.quantize == "int4":
            # The Linears' weights 4-bit (layers/int4.py; any the kernel does not take packed float32
            # as below), the LM head int8 (as llama.cpp's files keep it, Q8_0).
            if not int4.available():
                raise ConfigError(
                    f"model {card.id}: quantize int4 needs torch's CPU int4 kernel "
                    "(_weight_int4pack_mm_for_cpu), which this torch lacks: drop quantize or use int8",
                    details={"model": card.id, "field": "quantize"},
                )
            int4.quantize_linears_int4(model)
        if packing and card.quantize != "int8":
            packed.pack_linears(model)
        own_head = lm_head_of(directory, model)  # None: tied to the embeddings
        decoder = CachedDecoder(model, cache, lm_head=own_head)
        if card.quantize == "int4":
            head = int4.Int8WeightLinear.of(decoder.lm_head)
            decoder.head, head_bytes = head, head.num_bytes
            if card.generate.compile:
                why = decoder.compile_span()
                if why is not None:
                    log.warning("model %s: one sequence's int4 decode steps stay eager: %s", card.id, why)
        else:
            head_bytes = decoder.pack_head() if packing else 0  # the head's packed copy
        if own_head is not None:  # a checkpoint's own head: held once, in what multiplies with it
            if card.quantize == "int4" or packing:
                decoder.drop_own_head()
            else:
                head_bytes += own_head.numel() * own_head.element_size()
            del own_head
        grammars = None
        try:
            from ..generate.constraints import Grammars

            grammars = Grammars(load_tokenizer(directory).to_str(), decoder.vocab_size, frame.eos_ids)
        except ImportError:  # llguidance (the generate extra) not installed: unconstrained only
            log.warning("model %s: llguidance is not installed; constrained output is refused", card.id)
        plain = tokenizer._plain_tokenizer()
        self.generator = Generator(
            decoder, frame.eos_ids, decode=lambda ids: plain.decode(ids, skip_special_tokens=True), grammars=grammars
        )
        self.grammars = grammars
        self.model = model
        self.card = card
        self.info = ModelInfo(card, tokenizer, ("text",), heads=(frame,))
        self.num_bytes = tensor_bytes([model]) + packed.packed_bytes(model) + head_bytes + cache.nbytes
        # A prefill of the most tokens a step packs: each layer's widest activations (the MLP's two
        # intermediate projections) plus the hidden states, a few times over.
        itemsize = torch.finfo(dtype).bits // 8
        self.workspace_bytes = (
            self.generator.max_prefill_tokens * (3 * config.intermediate_size + 8 * config.hidden_size) * itemsize
        )
        self.generation = GenerationLoop(self.generator, threads, card.id.split("/")[-1])

    def compile(self, constraint: tuple[str, Any]) -> str:
        """The grammar of a GenerateSpec's constraint (cached by shoal.generate.constraints);
        InvalidRequest if it cannot be used. Call it off the event loop and off the generation loop."""
        if self.grammars is None:
            raise InvalidRequest("constrained output needs llguidance on the server (pip install 'shoal[generate]')")
        kind, value = constraint
        with _COMPILE_LOCK:
            if kind == "json_schema":
                return self.grammars.json_schema(value)
            if kind == "json_object":
                return self.grammars.json_schema({"type": "object"})
            if kind == "regex":
                return self.grammars.regex(value)
            if kind == "choice":
                return self.grammars.choice(value)
        raise InvalidRequest(f"unknown constraint {kind!r}")

    def forward(self, batch: Batch, specs: collections.abc.Sequence[Spec]) -> list[object]:
        raise ConfigError(f"model {self.card.id} generates: its calls run on its generation loop, not in batches")

    def add_adapter(self, name: str, directory: Path) -> int:
        raise InvalidRequest(f"model {self.card.id} generates; LoRA adapters are not served for generation yet")

    def remove_adapter(self, name: str) -> None:
        return None

    def adapter_slot(self, name: str) -> int | None:
        return None

    def adapter_bytes(self, name: str) -> int:
        return 0

    def close(self) -> None:
        self.generation.close()
        if self.generator._mask_thread is not None:
            self.generator._mask_thread.shutdown(wait=False)


# Grammars keep an LRU of compiled constraints: one compile at a time.
_COMPILE_LOCK = threading.Lock()


def chat_frame(directory: Path, tokenizer: TextTokenizer) -> ChatFrame:
    """The folder's chat template (chat_template.jinja, else tokenizer_config.json's
    `chat_template`) and end-of-sequence ids (generation_config.json's, and the tokenizer's
    eos_token)."""
    config = _json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    eos_ids: list[int] = []
    generation = _json(directory / "generation_config.json").get("eos_token_id")
    for value in generation if isinstance(generation, list) else [generation]:
        if isinstance(value, int) and value not in eos_ids:
            eos_ids.append(value)
    if eos:
        try:
            token = tokenizer.token_id(eos)
        except (KeyError, ValueError, ShoalError):
            token = None
        if token is not None and token not in eos_ids:
            eos_ids.append(token)
    if not eos_ids:
        raise ModelLoadError(f"{directory.name}: no end-of-sequence token (generation_config.json, eos_token)")
    frame = ChatFrame(template if isinstance(template, str) else None, bos, eos, tuple(eos_ids))
    if frame.template is not None:
        from jinja2 import TemplateError

        from ..head_info import _compiled_template

        try:  # a template that does not compile fails the load, not every chat
            _compiled_template(frame.template)
        except TemplateError as exc:
            raise ModelLoadError(f"{directory.name}: its chat template does not compile: {exc}") from None
    return frame


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""
