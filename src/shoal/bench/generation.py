"""`shoal bench MODEL --workload chat`: generation on a served decoder at fixed concurrency, beside
transformers' `generate` on the same weights in this process (`--against transformers`).

At each level N (`--levels`, default 1,8,32 concurrent requests): N streamed chat completions at
once (`POST /v1/chat/completions`, greedy, `NEW_TOKENS` new tokens, the prompts below in turn),
`ROUNDS` times, the best round kept. Reported per level: generated tokens per second over the
round's wall time (the answers' `usage.completion_tokens`), and the time to first token (to the
first content event) on average. transformers: the same N prompts as one left-padded batch,
`generate` greedy (its time to first token: `generate` with one new token). Their ratio. The
server's KV cache slots bound how many run at once (the card's `generate.slots`): the rest wait,
and their wait is in their time to first token, as a user would see it.

Before timing, the first prompt's greedy answer from the server must equal transformers' (the
same text), or the run stops: a faster wrong answer is not a result.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from contextlib import ExitStack
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


def run_chat(args: Any, card: Any) -> int:
    """The chat workload (see the module docstring)."""
    from ..catalog import resolve_weights
    from . import machine

    if "generate" not in card.tasks:
        raise ConfigError(f"{card.id} serves {', '.join(sorted(card.tasks))}; workload chat needs generate")
    against = [a for spec in args.against or [] for a in spec.split(",") if a]
    if set(against) - {"transformers"}:
        raise ConfigError("--against: workload chat is compared with transformers (in-process generate) only")
    levels = [int(level) for level in args.levels or LEVELS]
    model_dir = None
    if against:
        try:
            model_dir = resolve_weights(card, allow_download=False)
        except ModelLoadError as exc:
            raise ConfigError(f"--against transformers needs the model's local folder: {exc.message}") from None
    print(f"shoal bench: {card.id}, workload chat ({NEW_TOKENS} new tokens, greedy, best of {ROUNDS} rounds)")
    load0 = machine.load_average()
    if load0:
        print(f"machine: load avg {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at start; client and server share it")
    baseline = Transformers(model_dir) if model_dir is not None else None
    record: dict[str, Any] = {"model": card.id, "workload": "chat", "new_tokens": NEW_TOKENS, "levels": {}}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        if args.url:
            url = args.url
        else:
            from .targets import shoal_serve

            serve_args = [a for d in args.models_dir or () for a in ("--models-dir", d)]
            url, _ = stack.enter_context(shoal_serve(card.id, Path(tmp) / "shoal.log", args=serve_args))
        if baseline is not None:
            served = asyncio.run(_first_answer(url, card.id, args.api_key))
            expected = baseline.first_answer()
            if served != expected:
                raise ConfigError(
                    f"the server's greedy answer differs from transformers': {served[:80]!r} vs {expected[:80]!r}"
                )
            print(f"equality: the first prompt's greedy answer equals transformers' ({len(expected)} characters)")
        header = f"{'N':>3} {'shoal tok/s':>12} {'ttft ms':>9}"
        if baseline is not None:
            header += f" {'transformers tok/s':>19} {'ttft ms':>9} {'ratio':>6}"
        print(header)
        for n in levels:
            best: dict[str, dict[str, float]] = {}
            for _ in range(ROUNDS):
                runs = {"shoal": asyncio.run(served_level(url, card.id, n, args.api_key))}
                if baseline is not None:
                    runs["transformers"] = baseline.level(n)
                for name, figures in runs.items():
                    if name not in best or figures["tokens_per_s"] > best[name]["tokens_per_s"]:
                        best[name] = figures
            line = f"{n:>3} {best['shoal']['tokens_per_s']:>12.1f} {best['shoal']['ttft_ms']:>9.0f}"
            if baseline is not None:
                ratio = best["shoal"]["tokens_per_s"] / best["transformers"]["tokens_per_s"]
                best["ratio"] = {"tokens_per_s": ratio}
                line += f" {best['transformers']['tokens_per_s']:>19.1f} {best['transformers']['ttft_ms']:>9.0f}"
                line += f" {ratio:>5.2f}x"
            print(line, flush=True)
            record["levels"][str(n)] = {k: {m: round(v, 2) for m, v in f.items()} for k, f in best.items()}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


async def _first_answer(url: str, model: str, token: str | None) -> str:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        return (await one_chat(client, model, 0, time.perf_counter()))[2]
