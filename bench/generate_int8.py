"""int8 and int4 decode (issue 39): how much faster, and how far from float32's answers, is a
generating card under `quantize: int8` or `quantize: int4` (engine/generation.py; layers/int8.py,
layers/int4.py)? SmolLM2-135M-Instruct's weights as the engine loads them (the card's GGUF,
dequantised to float32), in this process:

- `float32`: Linears and the tied LM head oneDNN-packed, as a generating model is served on a CPU;
- `int8`: as a card or tuned overlay with `quantize: int8` is served: every Linear int8 (per-row
  weight scales, per-token activation scales, outlier input channels kept float32 as the float32
  model's read of the runner's calibration texts shows them); the LM head packed float32;
- `int8+head`: the LM head int8 too (not served: no outlier channels for it);
- `int4`: as `quantize: int4` is served: every Linear's weights 4-bit in groups of 32 (the GGUF's
  own Q4_1 levels), the LM head (the file's Q8_0 embeddings) int8 per row, bfloat16 activations
  at the products, and one sequence's decode steps through the torch.compile'd layer
  (generate/forward.py `compile_span`, as the card's `generate.compile` defaults);
- `int4-eager`: the same, its steps eager (`generate.compile: false`);
- `int4+head4`: the LM head 4-bit too; `int4+head32`: the LM head packed float32 (neither served);
- `bfloat16`: as a card with `dtype: bfloat16` is served: weights, activations and KV cache in
  bfloat16 (oneDNN's bf16 products; native on CPUs with AVX512-BF16 or AMX).

First each one's greedy answers to the 8 prompts at once (64 new tokens) against float32's: the
length of the prefix each keeps. Then tokens/s at N concurrent sequences (the Generator driven to
the end: one prefill, then decode steps), best of `--rounds`. `--step`: first, one sequence's
decode step in ms ((the time to its new tokens - the time to its first) / the rest, best of 3
each; the first prompt's answer runs to 64).

    python bench/generate_int8.py --rounds 2 [--step]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from shoal.bench.generation import QUESTIONS, messages
from shoal.catalog import Catalog, resolve_weights
from shoal.engine.runner import quantize_int8
from shoal.engine.tokenizer import TextTokenizer
from shoal.generate.batcher import GenerationRequest, Generator
from shoal.generate.forward import CachedDecoder
from shoal.generate.kv_cache import PagedCache
from shoal.layers import packed
from shoal.layers.int4 import Int4Linear, Int8WeightLinear, quantize_linears_int4
from shoal.layers.int8 import Int8Linear
from shoal.weights import build_model
from spawn import machine_line

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WAYS = ("float32", "int8", "int8+head", "int4", "int4-eager", "int4+head4", "int4+head32", "bfloat16")


def generator(directory, way: str, eos: list[int], slots: int) -> Generator:
    dtype = "bfloat16" if way == "bfloat16" else "float32"
    model = build_model(directory, None, "cpu", dtype)
    cfg = model.config

    def cache(n: int) -> PagedCache:
        return PagedCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            slots=n,
            max_len=512,
            block_size=16,
            dtype=getattr(torch, dtype),
        )

    if way == "bfloat16":  # as a card with dtype bfloat16 is served: plain Linears, nothing packed
        return Generator(CachedDecoder(model, cache(slots)), eos)
    if way == "float32":
        packed.pack_linears(model)
    elif way.startswith("int4"):  # as GeneratingModel does under quantize: int4
        quantize_linears_int4(model)
    else:  # as GeneratingModel does under quantize: int8
        quantize_int8(model, TextTokenizer.from_dir(directory, 2048))
    decoder = CachedDecoder(model, cache(slots))
    if way in ("int4", "int4-eager"):  # as GeneratingModel does under quantize: int4
        decoder.head = Int8WeightLinear.of(decoder.lm_head)
        why = decoder.compile_span() if way == "int4" else None
        if why is not None:
            raise SystemExit(f"int4: the decode layer did not compile: {why}")
    elif way in ("int8+head", "int4+head4"):
        head = torch.nn.Linear(decoder.lm_head.shape[1], decoder.lm_head.shape[0], bias=False)
        head.weight = torch.nn.Parameter(decoder.lm_head, requires_grad=False)
        decoder.head = Int8Linear.of(head, None) if way == "int8+head" else Int4Linear.of(head)
    else:
        decoder.pack_head()
    return Generator(decoder, eos)


def generate(gen: Generator, prompts: list[tuple[int, ...]], n: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    """(tokens/s, each sequence's tokens) of n sequences run to the end."""
    started = time.perf_counter()
    sequences = gen.run(GenerationRequest(prompts[i % len(prompts)], max_new_tokens=new_tokens) for i in range(n))
    tokens = [list(s.tokens) for s in sequences]
    return sum(map(len, tokens)) / (time.perf_counter() - started), tokens


def _timed(gen: Generator, prompt: tuple[int, ...], new_tokens: int) -> tuple[float, int]:
    """(seconds, tokens) of one sequence run to `new_tokens` or its end."""
    started = time.perf_counter()
    (done,) = gen.run([GenerationRequest(prompt, max_new_tokens=new_tokens)])
    return time.perf_counter() - started, len(done.tokens)


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    print(machine_line())
    directory = resolve_weights(Catalog.load().get(MODEL))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = [
        tokenizer.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False)
        for i in range(len(QUESTIONS))
    ]
    prompts = [tuple(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    eos = [tokenizer.eos_token_id]
    ways = args.ways
    if ways[0] != "float32" or set(ways) - set(WAYS):
        raise SystemExit(f"--ways: float32 first, then any of {', '.join(WAYS[1:])}")
    gens = {way: generator(directory, way, eos, max([*args.concurrency, len(prompts)])) for way in ways}
    reference = generate(gens["float32"], prompts, len(prompts), args.new_tokens)[1]
    print(f"{MODEL}, {args.new_tokens} new tokens, greedy, torch threads {torch.get_num_threads()}")
    for way in ways[1:]:
        answers = generate(gens[way], prompts, len(prompts), args.new_tokens)[1]
        kept = [
            next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            for ours, theirs in zip(answers, reference)
        ]
        print(f"{way}: the greedy answers keep float32's first {kept} tokens (of {args.new_tokens})")
    if args.step:  # one sequence's decode step: (all its new tokens - the first) / the rest, best of 3 each
        for way in ways:
            one = min(_timed(gens[way], prompts[0], 1) for _ in range(3))[0]
            full, n = min(_timed(gens[way], prompts[0], args.new_tokens) for _ in range(3))
            step = f"{(full - one) / (n - 1) * 1e3:.2f} ms" if n > 1 else "(its answer is one token)"
            print(f"{way}: one sequence's decode step {step} ({n} tokens)", flush=True)
    print(f"{'N':>3} " + " ".join(f"{way + ' tok/s':>16}" for way in ways))
    for n in args.concurrency:
        best = {
            way: max(generate(gens[way], prompts, n, args.new_tokens)[0] for _ in range(args.rounds)) for way in ways
        }
        print(f"{n:>3} " + " ".join(f"{best[way]:>16.1f}" for way in ways), flush=True)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step", action="store_true", help="also time one sequence's decode step")
    ap.add_argument("--ways", type=lambda s: s.split(","), default=list(WAYS), help="float32 first")
    sys.exit(main(ap.parse_args()))
