"""Generation served (issue 39): `POST /v1/chat/completions` through the real `openai` client and
`POST /v1/extract` on a generating model, on a real server with SmolLM2-135M-Instruct's real
weights (the card's GGUF source; conftest.smollm2_causal gives transformers' model on the same
weights as the reference).

Greedy answers equal transformers' `generate` on the prompt transformers' own chat template makes;
every constrained answer validates with `jsonschema`; bad requests are 4xx before any KV cache slot
is taken; a client that goes away frees its slot; encoder calls are not held behind generations.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import jsonschema
import pytest
import torch

from conftest import MODEL_ID, SMOLLM2_ID

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
    "Who wrote Romeo and Juliet?",
    "What do bees make?",
    "Say hello in Spanish.",
    "What is the opposite of hot?",
    "Name a planet.",
]
NEW_TOKENS = 24

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TICKET = {
    "type": "object",
    "properties": {
        "priority": {"enum": ["low", "medium", "high"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["priority", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(serve):
    return serve(preload=(SMOLLM2_ID, MODEL_ID))


@pytest.fixture(scope="module")
def loop_of(serve, server):
    """The SmolLM2 model's generation loop on the server (engine/generation.py)."""
    return serve.engines[server].cache.runner(SMOLLM2_ID).generation


@pytest.fixture(scope="module")
def chat(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def hf(smollm2_causal):
    from transformers import AutoTokenizer

    directory, reference = smollm2_causal
    return AutoTokenizer.from_pretrained(directory), reference


def reference_answer(hf, messages: list[dict], new_tokens: int = NEW_TOKENS) -> tuple[str, int, int]:
    """transformers' greedy answer to `messages`: (text, prompt tokens, new tokens)."""
    tokenizer, model = hf
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), ids.shape[1], len(new)


def wait_idle(loop_of, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (loop_of.in_use or loop_of.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (loop_of.in_use, loop_of.waiting) == (0, 0), "KV cache slots still held"


def test_chat_template_renders_as_transformers_renders_it(serve, server, hf):
    from shoal.head_info import ChatFrame

    frame = serve.engines[server].cache.runner(SMOLLM2_ID).info.head(ChatFrame)
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    ):
        assert frame.render(messages) == hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_greedy_chat_completions_equal_transformers_generate_side_by_side(chat, hf, loop_of):
    """Ten chats at once (sharing the KV cache pool), each equal to transformers' greedy answer
    alone, with the same token counts."""
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    expected = [reference_answer(hf, m) for m in messages]

    def ask(m):
        return chat.chat.completions.create(model=SMOLLM2_ID, messages=m, temperature=0, max_tokens=NEW_TOKENS)

    with concurrent.futures.ThreadPoolExecutor(len(messages)) as pool:
        answers = list(pool.map(ask, messages))
    for answer, (text, prompt_tokens, new_tokens) in zip(answers, expected):
        choice = answer.choices[0]
        assert choice.message.content == text
        assert choice.message.role == "assistant"
        assert choice.finish_reason == ("length" if new_tokens == NEW_TOKENS else "stop")
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, new_tokens)
        assert answer.model == SMOLLM2_ID and answer.object == "chat.completion"
    wait_idle(loop_of)


def test_streamed_chat_is_the_answer_in_pieces(chat, hf):
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    whole = chat.chat.completions.create(model=SMOLLM2_ID, messages=messages, temperature=0, max_tokens=40)
    pieces, finish, usage = [], None, None
    stream = chat.chat.completions.create(
        model=SMOLLM2_ID,
        messages=messages,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(pieces) > 5  # token by token, not one piece at the end
    assert "".join(pieces) == whole.choices[0].message.content == reference_answer(hf, messages, 40)[0]
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_end_the_answer_before_them(chat, hf):
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    full = reference_answer(hf, messages, 40)[0]
    stop = full.split()[2]  # a word the greedy answer reaches
    answer = chat.chat.completions.create(
        model=SMOLLM2_ID, messages=messages, temperature=0, max_tokens=40, stop=[stop]
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == full[: full.index(stop)]


def test_openais_other_spellings_mean_what_they_mean_there(chat, hf):
    """A "developer" message is a system message; top_p 0 is greedy; any int64 seed is taken; no
    max_tokens on a long chat leaves the answer what the context has room for (not a 400)."""
    question = {"role": "user", "content": "Name a colour."}

    def ask(**options):
        return chat.chat.completions.create(model=SMOLLM2_ID, max_tokens=16, **options)

    as_system = ask(messages=[{"role": "system", "content": "Answer in French."}, question], temperature=0)
    as_developer = ask(messages=[{"role": "developer", "content": "Answer in French."}, question], temperature=0)
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
    greedy = reference_answer(hf, [question], 16)[0]
    assert ask(messages=[question], temperature=1.0, top_p=0).choices[0].message.content == greedy
    assert ask(messages=[question], temperature=0.7, seed=-5).choices[0].finish_reason in ("stop", "length")
    long = chat.chat.completions.create(
        model=SMOLLM2_ID, messages=[{"role": "user", "content": "tree " * 1980 + "Name a colour."}], temperature=0
    )
    assert long.usage.prompt_tokens + long.usage.completion_tokens <= 2048
    assert long.usage.completion_tokens < 256  # the card's default, cut to the context's room


def test_every_json_schema_answer_validates(chat, loop_of):
    """response_format json_schema: greedy and sampled answers, two schemas (enums, bounded arrays
    and strings, integer ranges, required and optional fields), all parse and validate."""
    prompts = [
        (PERSON, "Describe a person called Maria who is 34 and lives in Lisbon."),
        (PERSON, "Tell me about Bob, a retired teacher aged 70."),
        (PERSON, "Make up a character for a story."),
        (TICKET, "The checkout page crashes whenever I click pay. Fix it now!"),
        (TICKET, "Could you add a dark mode some day?"),
        (TICKET, "My invoice shows the wrong address."),
    ]

    def ask(args):
        (schema, text), temperature = args
        return schema, chat.chat.completions.create(
            model=SMOLLM2_ID,
            messages=[{"role": "user", "content": text}],
            temperature=temperature,
            seed=7,
            max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema}},
        )

    jobs = [(p, t) for p in prompts for t in (0.0, 0.8)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    for schema, answer in answers:
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    obj = chat.chat.completions.create(
        model=SMOLLM2_ID,
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_object"},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    wait_idle(loop_of)


def test_extract_fills_the_schema_from_each_text(server, loop_of):
    texts = ["Alice Smith is 31 and lives in Paris.", "Bob, aged 45, works in Berlin.", "Carol is 27."]
    answer = httpx.post(
        f"{server}/v1/extract",
        json={"model": SMOLLM2_ID, "items": [{"text": t} for t in texts], "schema": PERSON},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [item["index"] for item in body["items"]] == [0, 1, 2]
    for item in body["items"]:
        assert item["finish_reason"] == "stop"
        jsonschema.validate(item["data"], PERSON)
    assert body["usage"]["tokens"] > 0 and body["usage"]["generated_tokens"] > 0
    # What the first text says, read by a 135M model (the card's extract prompt, greedy).
    assert body["items"][0]["data"] == {"name": "Alice Smith", "age": 31, "city": "Paris"}
    wait_idle(loop_of)


@pytest.mark.parametrize(
    "body, says",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "JSON Schema cannot be used",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                            "required": ["a"],
                        },
                    },
                }
            },
            "cannot be used",
        ),
        ({"messages": [{"role": "user", "content": "word " * 3000}]}, "context holds"),
        ({"max_tokens": 5000}, "no room for the prompt"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"n": 2}, "one choice"),
        ({"temperature": 7}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ],
)
def test_bad_chat_requests_are_400_and_take_no_slot(server, loop_of, body, says):
    request = {"model": SMOLLM2_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body}
    for stream in (False, True):
        answer = httpx.post(f"{server}/v1/chat/completions", json={**request, "stream": stream}, timeout=60)
        assert answer.status_code == 400, answer.text
        assert says in answer.json()["error"]["message"]
    assert (loop_of.in_use, loop_of.waiting) == (0, 0)


def test_bad_extract_requests_are_400(server):
    for body, says in (
        ({}, "schema is required"),
        ({"schema": PERSON, "labels": ["person"]}, "no labels"),
        ({"schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}, "cannot be used"),
    ):
        answer = httpx.post(
            f"{server}/v1/extract", json={"model": SMOLLM2_ID, "items": [{"text": "Alice is 31."}], **body}, timeout=60
        )
        assert answer.status_code == 400, answer.text
        assert says in answer.json()["error"]["message"]


def test_a_client_that_goes_away_frees_its_slot(server, loop_of):
    """Streamed: the client closes after a few events; not streamed: its read times out. Either
    way the generation stops within a step and the pool is empty again, long before the 400 tokens
    asked for could have been written."""
    request = {
        "model": SMOLLM2_ID,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 400,
        "temperature": 0,
    }
    started = time.monotonic()
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server}/v1/chat/completions", json={**request, "stream": True}) as answer:
            assert answer.status_code == 200
            events = 0
            for line in answer.iter_lines():
                events += line.startswith("data: ")
                if events >= 4:
                    break
            assert loop_of.in_use == 1
    wait_idle(loop_of, 10.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/chat/completions", json=request, timeout=httpx.Timeout(60, read=1.5))
    wait_idle(loop_of, 10.0)
    assert time.monotonic() - started < 15  # 400 tokens at this model's ~20/s would take 20 s each


def test_a_chat_that_would_wait_past_its_deadline_for_a_slot_is_refused_at_once(server, loop_of):
    """Every KV cache slot held by a long streamed chat (32 on SmolLM2's card): a chat whose
    deadline (`timeout_s`) comes before a slot would be free is answered 503 with Retry-After at
    once, naming the slots, rather than waiting to a 504; the streams run on, and once they are
    closed the pool is empty again."""
    import contextlib

    warm = {"model": SMOLLM2_ID, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 48}
    for _ in range(2):  # the loop's step time and typical answer length are measured
        assert httpx.post(f"{server}/v1/chat/completions", json=warm, timeout=120).status_code == 200
    long = {
        "model": SMOLLM2_ID,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as streams:
        for _ in range(loop_of.slots):
            answer = streams.enter_context(client.stream("POST", f"{server}/v1/chat/completions", json=long))
            assert answer.status_code == 200  # its first token is out
        assert loop_of.in_use == loop_of.slots
        refused = client.post(f"{server}/v1/chat/completions", json={**warm, "timeout_s": 0.5})
        assert refused.status_code == 503, refused.text  # refused, not left to its deadline (504)
        assert int(refused.headers["retry-after"]) >= 1
        assert "KV cache slots" in refused.json()["error"]["message"]
        assert loop_of.in_use == loop_of.slots  # the running streams were not touched
    wait_idle(loop_of, 30.0)


def test_encoder_calls_are_not_held_behind_a_generation(server, loop_of):
    request = {
        "model": SMOLLM2_ID,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server}/v1/chat/completions", json=request) as answer:
            lines = answer.iter_lines()
            next(lines)  # generating
            embedded = client.post(f"{server}/v1/embeddings", json={"model": MODEL_ID, "input": ["a lighthouse"]})
            assert embedded.status_code == 200
            assert loop_of.in_use == 1  # answered while the generation still runs
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


def test_generations_are_counted_in_the_metrics(server):
    from conftest import metric_total

    page = f"{server}/metrics"
    tokens, firsts = "shoal_generated_tokens_total", "shoal_time_to_first_token_seconds_count"
    before = metric_total(page, tokens, model=SMOLLM2_ID), metric_total(page, firsts, model=SMOLLM2_ID)
    answer = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": SMOLLM2_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0},
        timeout=60,
    ).json()
    after = metric_total(page, tokens, model=SMOLLM2_ID), metric_total(page, firsts, model=SMOLLM2_ID)
    assert after[0] - before[0] == answer["usage"]["completion_tokens"] > 0
    assert after[1] - before[1] == 1


def test_models_list_says_the_model_generates(server):
    entry = httpx.get(f"{server}/v1/models/{SMOLLM2_ID}").json()
    assert set(entry["tasks"]) == {"generate", "extract"}
    assert entry["verified"] == "real_weights"


def test_a_generation_through_the_gateway_keeps_its_lease_and_equals_the_direct_answer(nats_url, hf):
    """A worker whose device is a real engine serving SmolLM2, its JetStream lease 1 s: a greedy chat
    of 48 tokens (several seconds here) comes back through the gateway equal to transformers'
    answer, computed once (in_progress kept the call; nothing was redelivered)."""
    import asyncio

    from shoal.calls import GenerateCall, Message
    from shoal.catalog import Catalog
    from shoal.config import EngineSettings
    from shoal.engine import Engine
    from test_cluster_light import cluster, sample

    messages = [{"role": "user", "content": "Describe a lighthouse at night."}]
    text, prompt_tokens, new_tokens = reference_answer(hf, messages, 48)

    async def body():
        engine = Engine(EngineSettings(), Catalog.load().restrict((SMOLLM2_ID,)), allow_download=False)
        await engine.start()
        try:
            async with cluster(nats_url, "generate", [[engine]], ack_wait_s=1.0) as (gateway, [worker]):
                call = GenerateCall(
                    SMOLLM2_ID, messages=[Message(**m) for m in messages], max_new_tokens=48, request_id="g"
                )
                started = time.monotonic()
                result = await gateway.run(call)
                took = time.monotonic() - started
                redelivered = sample(worker.metrics, "shoal_worker_redelivered_calls_total", model=SMOLLM2_ID)
                return result, took, redelivered
        finally:
            await engine.stop()

    result, took, redelivered = asyncio.run(body())
    assert (result.text, result.prompt_tokens, result.completion_tokens) == (text, prompt_tokens, new_tokens)
    assert took > 1.0 and redelivered == 0  # longer than the lease, and kept


def test_a_chat_streamed_through_the_gateway_is_the_direct_answer_in_pieces(nats_url, hf):
    """The real `openai` client over HTTP to a cluster gateway (`create_app` over RemoteService, as
    `shoal gateway` serves it), a worker whose device is a real engine serving SmolLM2: a streamed
    greedy chat arrives in several pieces that join to transformers' answer; the worker sent the
    updates to the gateway's inbox before the answer. Leaving a stream early through
    `RemoteService.stream` ends the generation on the worker (its KV cache slot is freed)."""
    import asyncio
    import contextlib

    import openai

    from conftest import running_server
    from shoal.api.app import create_app
    from shoal.calls import GenerateCall, Message
    from shoal.catalog import Catalog
    from shoal.cluster.gateway import RemoteService
    from shoal.cluster.worker import Worker
    from shoal.config import ClusterSettings, EngineSettings, Settings
    from shoal.engine import Engine
    from shoal.metrics import Metrics
    from test_cluster_light import sample

    messages = [{"role": "user", "content": "Describe a lighthouse at night."}]
    text, _, _ = reference_answer(hf, messages, 40)
    cluster = ClusterSettings(nats_url=nats_url, pool="stream", heartbeat_s=0.2, worker_ttl_s=2.0)
    settings = Settings(cluster=cluster, engine=EngineSettings(request_timeout_s=60.0))

    def chat_over_http(gateway: RemoteService) -> list[str]:
        with running_server(create_app(settings, gateway)) as url:  # the gateway starts on the server's loop
            deadline = time.monotonic() + 20
            while not (gateway.ready and any(b.pool == "stream" for b in gateway.workers.live())):
                assert time.monotonic() < deadline, "the gateway never saw the worker"
                time.sleep(0.05)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            chunks = client.chat.completions.create(
                model=SMOLLM2_ID, messages=messages, max_tokens=40, temperature=0, stream=True
            )
            return [c.choices[0].delta.content or "" for c in chunks if c.choices]

    async def body():
        engine = Engine(EngineSettings(), Catalog.load().restrict((SMOLLM2_ID,)), allow_download=False)
        await engine.start()
        stop = asyncio.Event()
        worker = Worker([engine], cluster, metrics=Metrics())
        task = asyncio.create_task(worker.run(stop))

        def cancelled() -> float:  # the worker's calls its caller left while they ran
            return sample(worker.metrics, "shoal_worker_calls_total", model=SMOLLM2_ID, outcome="dropped_cancelled")

        try:
            pieces = await asyncio.to_thread(chat_over_http, RemoteService(settings, Catalog.load()))
            # Leaving early, in process: the worker's generation ends and its slot comes back.
            gateway = RemoteService(settings, Catalog.load())
            await gateway.start()
            try:
                deadline = time.monotonic() + 20
                while not (gateway.ready and any(b.pool == "stream" for b in gateway.workers.live())):
                    assert time.monotonic() < deadline, "the gateway never saw the worker"
                    await asyncio.sleep(0.05)
                call = GenerateCall(SMOLLM2_ID, messages=[Message(**m) for m in messages], max_new_tokens=200)
                updates = gateway.stream(call)
                async with contextlib.aclosing(updates):
                    first = await anext(updates)
                loop = engine.cache.runner(SMOLLM2_ID).generation
                deadline = time.monotonic() + 20
                while (loop.in_use or not cancelled()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return pieces, first, loop.in_use, cancelled()
            finally:
                await gateway.stop()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await engine.stop()

    pieces, first, in_use, cancelled = asyncio.run(body())
    assert "".join(pieces) == text
    assert sum(1 for piece in pieces if piece) > 3  # streamed in pieces, not one answer at the end
    assert first.text and not first.token_ids  # an update: the text so far (token ids stay on the worker)
    assert (cancelled, in_use) == (1, 0)  # the worker dropped the generation it ran, and freed its slot


def test_shoal_bench_chat_measures_tokens_per_second_and_ttft_beside_transformers_and_llama_cpp(server, tmp_path):
    """`shoal bench MODEL --workload chat --against transformers,llama.cpp` on the running server:
    the first prompt's greedy answer is checked equal to transformers' and picked by llama.cpp on
    the card's GGUF file (teacher-forced) before any timing, then each level's tokens/s and time to
    first token, every side, and the ratios, printed and in the JSON."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "chat.json"
    shoal = str(Path(sys.executable).with_name("shoal"))
    argv = ["bench", SMOLLM2_ID, "--url", server, "--workload", "chat", "--levels", "1,3"]
    proc = subprocess.run(
        [shoal, *argv, "--against", "transformers,llama.cpp", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "equality: the first prompt's greedy answer equals transformers'" in proc.stdout
    record = json.loads(out.read_text())
    agreement = record["agreement"]["llama.cpp"]
    assert agreement["picked"] >= 0.6 * agreement["of"] > 0, agreement
    assert list(record["levels"]) == ["1", "3"]
    for level in record["levels"].values():
        for side in ("shoal", "transformers", "llama.cpp"):
            assert level[side]["tokens_per_s"] > 0 and level[side]["ttft_ms"] > 0 and level[side]["tokens"] > 0
            if side != "shoal":
                assert level[f"ratio_{side}"]["tokens_per_s"] == pytest.approx(
                    level["shoal"]["tokens_per_s"] / level[side]["tokens_per_s"], abs=0.01
                )  # the JSON's figures are rounded to two decimals
    assert record["levels"]["3"]["shoal"]["tokens"] > record["levels"]["1"]["shoal"]["tokens"]
    assert record["levels"]["3"]["llama.cpp"]["tokens"] > record["levels"]["1"]["llama.cpp"]["tokens"]


def test_langchains_chat_openai_chats_and_fills_a_schema(server):
    """LangChain's ChatOpenAI against the server: a plain chat, and `with_structured_output` (OpenAI's
    json_schema response format, strict) giving a dict that validates."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server}/v1", api_key="x", model=SMOLLM2_ID, temperature=0, max_tokens=40)
    reply = chat.invoke("What is the capital of France?")
    assert "Paris" in reply.content
    structured = chat.with_structured_output(
        {"title": "city", "description": "A city and its country", **TICKET_CITY}, method="json_schema"
    )
    record = structured.invoke("Paris is the capital of France.")
    jsonschema.validate(record, TICKET_CITY)


TICKET_CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
