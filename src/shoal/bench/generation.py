"""`shoal bench MODEL --workload chat`: generation on a served decoder at fixed concurrency, beside
transformers' `generate` on the same weights in this process (`--against transformers`) and
llama.cpp on the card's GGUF file (`--against llama.cpp`, llama-cpp-python's bindings; class
LlamaCpp says how it batches).

At each level N (`--levels`, default 1,8,32 concurrent requests): N streamed chat completions at
once (`POST /v1/chat/completions`, greedy, `NEW_TOKENS` new tokens, the prompts below in turn),
`ROUNDS` times, the best round kept. Reported per level: generated tokens per second over the
round's wall time (the answers' `usage.completion_tokens`), and the time to first token (to the
first content event) on average. transformers: the same N prompts as one left-padded batch,
`generate` greedy (its time to first token: `generate` with one new token). Their ratio. The
server's KV cache slots bound how many run at once (the card's `generate.slots`): the rest wait,
and their wait is in their time to first token, as a user would see it.

Before timing, the first prompt's greedy answer from the server must equal transformers' (the
same text), or the run stops: a faster wrong answer is not a result. A model the server runs in
a lower precision (int8 from `quantize: int8`, or bfloat16/float16: `precision` in `/v1/models`)
drifts from float32 after a few tokens: fed its answer, transformers must pick at least
`QUANTISED_AGREEMENT` of its tokens (measured on int8). llama.cpp computes in its own
quantised arithmetic, so its greedy answer drifts from the server's after a few tokens; fed the
server's answer token by token, it must pick at least `AGREEMENT` of them itself (the same model,
tokenized alike), or the run stops. Both counts are printed and in the JSON.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from ..errors import ConfigError, ModelLoadError

QUESTIONS = (
    "Write a short story about a fish.",
    "Explain how a bicycle works.",
    "List ten fruits and their colours.",
    "Describe the water cycle.",
    "What makes a good cup of tea?",
    "Summarise the plot of a detective novel.",
    "Give advice to a new programmer.",
    "Describe a busy market in the morning.",
)
NEW_TOKENS = 64
ROUNDS = 2
LEVELS = (1, 8, 32)


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


async def one_chat(client: httpx.AsyncClient, model: str, i: int, started: float) -> tuple[float, int, str]:
    """(seconds to the first content event, completion tokens, the text) of one streamed chat."""
    body = {
        "model": model,
        "messages": messages(i),
        "temperature": 0,
        "max_tokens": NEW_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, tokens, text = None, 0, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            raise ConfigError(f"chat {i}: {answer.status_code} {(await answer.aread()).decode()[:300]}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise ConfigError(f"chat {i}: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - started
                    text.append(piece)
    return (first if first is not None else time.perf_counter() - started), tokens, "".join(text)


async def served_level(url: str, model: str, n: int, token: str | None) -> dict[str, float]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=n + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers, limits=limits) as client:
        started = time.perf_counter()
        answers = await asyncio.gather(*(one_chat(client, model, i, started) for i in range(n)))
        wall = time.perf_counter() - started
    tokens = sum(a[1] for a in answers)
    return {"tokens_per_s": tokens / wall, "ttft_ms": 1000 * sum(a[0] for a in answers) / n, "tokens": tokens}


class Transformers:
    """transformers' causal LM on the model's folder, float32, greedy batches in this process."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())

    def _batch(self, n: int) -> Any:
        texts = [
            self.tokenizer.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False)
            for i in range(n)
        ]
        return self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def first_answer(self) -> str:
        """The greedy answer to the first prompt."""
        batch = self._batch(1)
        with self.torch.no_grad():
            out = self.model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        return str(self.tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True))

    def agreement(self, answer: str) -> tuple[int, int]:
        """(how many of `answer`'s tokens, an answer to the first prompt from elsewhere, this model's
        greedy choice picks too when fed the prompt and the answer up to each one; of how many)."""
        prompt = self._batch(1)["input_ids"]
        ids = self.tokenizer(answer, return_tensors="pt", add_special_tokens=False)["input_ids"]
        whole = self.torch.cat([prompt, ids], dim=1)
        with self.torch.no_grad():
            logits = self.model(input_ids=whole).logits[0, prompt.shape[1] - 1 : -1]
        return int((logits.argmax(-1) == ids[0]).sum()), ids.shape[1]

    def level(self, n: int) -> dict[str, float]:
        batch = self._batch(n)
        pad = self.tokenizer.pad_token_id
        with self.torch.no_grad():
            started = time.perf_counter()
            self.model.generate(**batch, max_new_tokens=1, do_sample=False, pad_token_id=pad)
            first = time.perf_counter() - started
            started = time.perf_counter()
            out = self.model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
            wall = time.perf_counter() - started
        tokens = 0
        for row in out[:, batch["input_ids"].shape[1] :].tolist():  # up to and with its first eos
            ends = [k for k, t in enumerate(row) if t in self.eos]
            tokens += ends[0] + 1 if ends else len(row)
        return {"tokens_per_s": tokens / wall, "ttft_ms": 1000 * first, "tokens": tokens}


class LlamaCpp:
    """llama.cpp through llama-cpp-python's bindings on the card's GGUF file, in this process: its
    own arithmetic (the file's quantised weights as they are; llama.cpp quantises activations to
    8 bits in those dot products), so its answers are not transformers' token for token. N
    sequences run as llama.cpp's server runs its parallel slots: one batch of every prompt, then
    one batch a step of the sequences still running, greedy on each sequence's logits. The prompts
    are the same token ids as transformers' (its tokenizer)."""

    def __init__(self, gguf: Path, tokenizer: Any, threads: int) -> None:
        try:
            import llama_cpp
        except ImportError:
            raise ConfigError(
                "--against llama.cpp needs llama-cpp-python (pip install llama-cpp-python: it builds "
                "llama.cpp from source, a few minutes)"
            ) from None
        self.lib = lib = llama_cpp
        self._quiet = lib.llama_log_callback(lambda *_: None)  # kept: llama.cpp calls it later
        lib.llama_log_set(self._quiet, None)
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), lib.llama_model_default_params())
        if not self.model:
            raise ConfigError(f"llama.cpp could not load {gguf}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.tokenizer = tokenizer
        self.threads = threads
        self.gguf = gguf

    def prompts(self, n: int) -> list[list[int]]:
        texts = [
            self.tokenizer.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False)
            for i in range(n)
        ]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    @contextmanager
    def _context(self, sequences: int, longest: int, batch_tokens: int) -> Iterator[tuple[Any, Any]]:
        """A llama.cpp context for `sequences` sequences of up to `longest` tokens each (one KV
        cache they share), and a batch of up to `batch_tokens` tokens; freed after."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_seq_max, params.n_ctx = sequences, sequences * 256 * -(-longest // 256)
        params.n_batch, params.n_ubatch = max(512, batch_tokens), 512
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True
        context = lib.llama_init_from_model(self.model, params)
        batch = lib.llama_batch_init(params.n_batch, 0, 1)
        try:
            yield context, batch
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(context)

    def _decode(self, context: Any, batch: Any, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (sequence, token, position, wants its logits) tokens."""
        for k, (seq, token, pos, logits) in enumerate(tokens):
            batch.token[k], batch.pos[k], batch.n_seq_id[k] = token, pos, 1
            batch.seq_id[k][0], batch.logits[k] = seq, logits
        batch.n_tokens = len(tokens)
        if self.lib.llama_decode(context, batch) != 0:
            raise ConfigError("llama.cpp's decode failed (its context is too small?)")

    def _greedy(self, context: Any, row: int) -> int:
        import numpy as np

        logits = self.lib.llama_get_logits_ith(context, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, n: int) -> tuple[list[list[int]], float, float]:
        """(each sequence's new tokens, seconds to the first tokens, seconds in all), greedy."""
        prompts = self.prompts(n)
        longest, total = max(map(len, prompts)) + NEW_TOKENS, sum(map(len, prompts))
        with self._context(n, longest, total) as (context, batch):
            started = time.perf_counter()
            tokens = [(seq, t, pos) for seq, ids in enumerate(prompts) for pos, t in enumerate(ids)]
            new: list[list[int]] = [[] for _ in prompts]
            positions = [len(ids) for ids in prompts]
            first = 0.0
            while tokens:
                last = {seq: k for k, (seq, _, _) in enumerate(tokens)}  # sequence -> its logits' row
                self._decode(context, batch, [(s, t, p, last[s] == k) for k, (s, t, p) in enumerate(tokens)])
                tokens = []
                for seq, row in last.items():
                    token = self._greedy(context, row)
                    new[seq].append(token)
                    if not self.lib.llama_vocab_is_eog(self.vocab, token) and len(new[seq]) < NEW_TOKENS:
                        tokens.append((seq, token, positions[seq]))
                        positions[seq] += 1
                first = first or time.perf_counter() - started
            return new, first, time.perf_counter() - started

    def agreement(self, answer: list[int]) -> int:
        """How many of `answer`'s tokens (an answer to the first prompt from elsewhere) llama.cpp's
        greedy choice picks too when fed the prompt and the answer up to each one: the same model
        in other arithmetic picks nearly all of them, another model or tokenizer few."""
        prompt = self.prompts(1)[0]
        ids = prompt + answer
        with self._context(1, len(ids), len(ids)) as (context, batch):
            self._decode(context, batch, [(0, t, pos, pos >= len(prompt) - 1) for pos, t in enumerate(ids)])
            rows = range(len(prompt) - 1, len(ids) - 1)
            return sum(self._greedy(context, row) == ids[row + 1] for row in rows)

    def first_answer(self) -> list[int]:
        """The greedy answer's token ids for the first prompt."""
        return self.generate(1)[0][0]

    def level(self, n: int) -> dict[str, float]:
        new, first, wall = self.generate(n)
        tokens = sum(map(len, new))  # up to and with each one's end of generation
        return {"tokens_per_s": tokens / wall, "ttft_ms": 1000 * first, "tokens": tokens}


def run_chat(args: Any, card: Any) -> int:
    """The chat workload (see the module docstring)."""
    import os

    from ..catalog import resolve_weights
    from ..catalog.resolve import packaged_gguf
    from . import machine
    from .targets import served_precision

    if "generate" not in card.tasks:
        raise ConfigError(f"{card.id} serves {', '.join(sorted(card.tasks))}; workload chat needs generate")
    against = [a for spec in args.against or [] for a in spec.split(",") if a]
    if set(against) - set(BASELINES):
        raise ConfigError(f"--against: workload chat is compared with {' and '.join(BASELINES)} (in this process)")
    levels = [int(level) for level in args.levels or LEVELS]
    baselines: dict[str, Any] = {}
    if against:
        try:
            model_dir = resolve_weights(card, allow_download=False)
        except ModelLoadError as exc:
            raise ConfigError(f"--against {','.join(against)} needs the model's local folder: {exc.message}") from None
        if "transformers" in against:
            baselines["transformers"] = Transformers(model_dir)
        if "llama.cpp" in against:
            from transformers import AutoTokenizer

            if (gguf := packaged_gguf(card)) is None:
                raise ConfigError(f"--against llama.cpp needs a GGUF file: {card.id}'s card names none in a package")
            baselines["llama.cpp"] = LlamaCpp(gguf, AutoTokenizer.from_pretrained(model_dir), os.cpu_count() or 1)
    print(f"shoal bench: {card.id}, workload chat ({NEW_TOKENS} new tokens, greedy, best of {ROUNDS} rounds)")
    load0 = machine.load_average()
    if load0:
        print(f"machine: load avg {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at start; client and server share it")
    record: dict[str, Any] = {"model": card.id, "workload": "chat", "new_tokens": NEW_TOKENS, "levels": {}}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        if args.url:
            url = args.url
        else:
            from .targets import shoal_serve

            serve_args = [a for d in args.models_dir or () for a in ("--models-dir", d)]
            url, _ = stack.enter_context(shoal_serve(card.id, Path(tmp) / "shoal.log", args=serve_args))
        if baselines:
            served = asyncio.run(_first_answer(url, card.id, args.api_key))
            precision = served_precision(url, card.id, args.api_key)
            record["precision"] = precision
            record["agreement"] = _check_answers(served, baselines, precision)
        header = f"{'N':>3} {'shoal tok/s':>12} {'ttft ms':>9}"
        for name in baselines:
            header += f" {name + ' tok/s':>19} {'ttft ms':>9} {'ratio':>6}"
        print(header)
        for n in levels:
            best: dict[str, dict[str, float]] = {}
            for _ in range(ROUNDS):
                runs = {"shoal": asyncio.run(served_level(url, card.id, n, args.api_key))}
                for name, baseline in baselines.items():
                    runs[name] = baseline.level(n)
                for name, figures in runs.items():
                    if name not in best or figures["tokens_per_s"] > best[name]["tokens_per_s"]:
                        best[name] = figures
            line = f"{n:>3} {best['shoal']['tokens_per_s']:>12.1f} {best['shoal']['ttft_ms']:>9.0f}"
            for name in baselines:
                ratio = best["shoal"]["tokens_per_s"] / best[name]["tokens_per_s"]
                best[f"ratio_{name}"] = {"tokens_per_s": ratio}
                line += f" {best[name]['tokens_per_s']:>19.1f} {best[name]['ttft_ms']:>9.0f} {ratio:>5.2f}x"
            print(line, flush=True)
            record["levels"][str(n)] = {k: {m: round(v, 2) for m, v in f.items()} for k, f in best.items()}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


# What the chat workload is compared with, each in this process on the model's own files.
BASELINES = {"transformers": Transformers, "llama.cpp": LlamaCpp}
# Below this share of the server's answer tokens picked by llama.cpp (teacher-forced), it is not
# the same model: on SmolLM2-135M's Q4_1 file against float32 it picks 0.9 and more (docs/benchmarks.md).
AGREEMENT = 0.6
# transformers (float32), fed the answer of a model the server runs in int8, must pick this share
# of its tokens: on SmolLM2-135M it picks 96 % over 20 prompts (tests/test_generate.py) and 58 of
# the first prompt's 64 (91 %); another model picks few.
QUANTISED_AGREEMENT = 0.8


def _check_answers(served: str, baselines: dict[str, Any], precision: str | None = None) -> dict[str, Any]:
    """The first prompt's greedy answers: transformers' must equal the server's (same float32
    weights: a faster wrong answer is not a result), or, where the server computes in a lower
    `precision` (int8, int4, bfloat16, float16), transformers fed the server's answer must pick
    `QUANTISED_AGREEMENT` of its tokens (an empty answer fails);
    llama.cpp computes in its own arithmetic, so its answer is not compared token for token: fed
    the server's answer, it must pick `AGREEMENT` of its tokens itself. The counts are printed;
    returns what was found."""
    found: dict[str, Any] = {}
    if "transformers" in baselines:
        reference = baselines["transformers"]
        expected = reference.first_answer()
        if served == expected:
            print(f"equality: the first prompt's greedy answer equals transformers' ({len(expected)} characters)")
            found["transformers"] = "equal"
        elif precision in (None, "float32"):
            raise ConfigError(
                f"the server's greedy answer differs from transformers': {served[:80]!r} vs {expected[:80]!r}"
            )
        else:
            picked, of = reference.agreement(served)
            print(
                f"agreement: the server computes in {precision}; fed its answer to the first prompt, "
                f"transformers (float32) picks {picked} of its {of} tokens"
            )
            if of == 0 or picked < QUANTISED_AGREEMENT * of:
                raise ConfigError(
                    f"transformers picks only {picked} of the server's {of} answer tokens ({precision}): "
                    f"under {QUANTISED_AGREEMENT:.0%}: the served model is not these weights, or its "
                    "quantisation broke it"
                )
            found["transformers"] = {"picked": picked, "of": of}
    if "llama.cpp" in baselines:
        llama = baselines["llama.cpp"]
        theirs = llama.first_answer()
        ours = list(llama.tokenizer(served, add_special_tokens=False)["input_ids"])
        same = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        picked = llama.agreement(ours)
        print(
            f"agreement: llama.cpp ({llama.gguf.name}, its own quantised arithmetic) answers the first prompt "
            f"with the server's first {same} tokens of {len(theirs)}; fed the server's answer, it picks "
            f"{picked} of its {len(ours)} tokens"
        )
        if picked < AGREEMENT * len(ours):
            raise ConfigError(
                f"llama.cpp picks only {picked} of the server's {len(ours)} answer tokens: {llama.gguf.name} "
                "is not the served model's weights, or the prompts are not tokenized alike"
            )
        found["llama.cpp"] = {"same_prefix": same, "tokens": len(theirs), "picked": picked, "of": len(ours)}
    return found


async def _first_answer(url: str, model: str, token: str | None) -> str:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        return (await one_chat(client, model, 0, time.perf_counter()))[2]
