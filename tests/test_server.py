"""`ssdlocal serve` end to end with the official `openai` client, in AR, SD and SSD:

- completions and chat completions at temperature 0 equal `ssdlocal generate --json`
  token for token, streamed and not, with usage and per-request `ssdlocal` stats;
- 8 concurrent streamed requests each equal their sequential result (and share batches);
- a client that disconnects cancels its rows, the others go on;
- bad requests get OpenAI's error body and the next request still succeeds;
- /metrics parses as Prometheus text and its counters move.

Servers run in this process on 127.0.0.1 and a free port (tests/support/server.py),
one per mode for the module, and are stopped at its end.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.cli import run_cli
from support.server import MODEL, LiveServer

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig
from support.drafts import draft_of

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little model",
    "def fibonacci(n):",
    "Hello",
    "import torch\nx = torch.zeros(3, 4)",
    "The cat sat on the mat. The mat was red and",
    "for i in range(10):",
    "Speculative decoding lets a small draft model propose tokens",
]
STATS_KEYS = {"acceptance_rate", "mean_accepted_len", "cache_hit_rate", "tokens_per_s", "mode"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def _config(tiny_dir, mode: str) -> EngineConfig:
    draft = None if mode == "ar" else str(tiny_dir["draft_llama"])
    return EngineConfig(
        target=ModelSpec(str(tiny_dir["llama"]), dtype="float32"),
        spec=SpecConfig(mode=Mode(mode), k=3, draft=draft_of(draft)),
        pin_cpus=False,
    )


@pytest.fixture(scope="module", params=["ar", "sd", "ssd"])
def server(request, tiny_dir):
    live = LiveServer(_config(tiny_dir, request.param))
    yield live
    live.close()


def ask(client, prompt: str, *, chat: bool, stream: bool, max_tokens: int = 16, **extra) -> dict:
    """One request; returns text, token ids, finish reason, usage and the ssdlocal stats."""
    body = {"return_token_ids": True, **extra}
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream, "extra_body": body}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if chat:
        reply = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        reply = client.completions.create(prompt=prompt, **common)
    if not stream:
        choice = reply.choices[0]
        text = choice.message.content if chat else choice.text
        return {
            "text": text,
            "ids": choice.model_extra["token_ids"],
            "finish": choice.finish_reason,
            "usage": reply.usage,
            "stats": reply.model_extra["ssdlocal"],
        }
    out = {"text": "", "ids": [], "finish": None, "usage": None, "stats": None}
    for chunk in reply:
        for choice in chunk.choices:
            out["text"] += (choice.delta.content or "") if chat else choice.text
            out["ids"] += choice.model_extra.get("token_ids") or []
            out["finish"] = choice.finish_reason or out["finish"]
        if chunk.model_extra.get("ssdlocal") is not None:
            out["stats"] = chunk.model_extra["ssdlocal"]
        if chunk.usage is not None:  # OpenAI's way: one final chunk, no choices
            assert out["usage"] is None and not chunk.choices, chunk
            out["usage"] = chunk.usage
    return out


def generate_json(monkeypatch, capsys, tiny_dir, mode: str, prompt: str, *extra: str) -> dict:
    args = [
        "generate",
        prompt,
        "--target",
        tiny_dir["llama"],
        "--dtype",
        "float32",
        "--mode",
        mode,
        "--k",
        "3",
        "--json",
        *extra,
    ]
    if mode != "ar":
        args += ["--draft", tiny_dir["draft_llama"]]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    return json.loads(out)["outputs"][0]


def metrics(live: LiveServer) -> dict[str, float]:
    """/metrics parsed with prometheus_client: sample name{labels} -> value."""
    status, text = live.get("/metrics")
    assert status == 200
    values = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_temperature_0_equals_generate_json(server, monkeypatch, capsys, tiny_dir, chat):
    prompt = "Write a function that returns the sum of a list of numbers."
    extra = ["--max-new-tokens", "16"] + (["--chat"] if chat else [])
    expected = generate_json(monkeypatch, capsys, tiny_dir, server.mode, prompt, *extra)
    for stream in (False, True):
        got = ask(server.client, prompt, chat=chat, stream=stream)
        assert got["ids"] == expected["token_ids"], (stream, got, expected)
        assert got["text"] == expected["text"]
        assert got["finish"] == {"eos": "stop", "stop": "stop", "length": "length"}[expected["finish_reason"]]
        assert got["usage"].completion_tokens == len(expected["token_ids"])
        assert got["usage"].total_tokens == got["usage"].prompt_tokens + got["usage"].completion_tokens
        assert STATS_KEYS <= set(got["stats"]) and got["stats"]["mode"] == server.mode
        if server.mode != "ar":
            assert 0 <= got["stats"]["acceptance_rate"] <= 1 and got["stats"]["mean_accepted_len"] >= 1
        assert (got["stats"]["cache_hit_rate"] is not None) == (server.mode == "ssd")


def test_concurrent_streams_equal_their_sequential_results(server):
    def run(prompt: str) -> dict:
        return ask(server.client, prompt, chat=False, stream=True, max_tokens=20, ignore_eos=True)

    sequential = [run(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(run, PROMPTS))
    for prompt, alone, together in zip(PROMPTS, sequential, concurrent):
        assert together["ids"] == alone["ids"] and together["text"] == alone["text"], prompt
        assert len(together["ids"]) == 20
    assert max(r["stats"]["batch_size"] for r in concurrent) > 1  # they shared the engine
    assert all(r["stats"]["batch_size"] == 1 for r in sequential)


def test_seeded_samples_repeat_and_equal_generate(server, monkeypatch, capsys, tiny_dir):
    """In every mode; in SSD the server pins what follows timing or earlier requests (an
    automatic fan-out: one candidate per accepted length; an automatic backup: jit)."""
    prompt = "Once upon a time"
    pinned = ["--fan-out", "1,1,1,1", "--fan-out-miss", "1,1,1,1", "--backup", "jit"] if server.mode == "ssd" else []
    expected = generate_json(
        monkeypatch,
        capsys,
        tiny_dir,
        server.mode,
        prompt,
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "1234",
        "--no-suffix",
        *pinned,
    )  # what it runs
    calls, real = [], server.engine.generate
    monkeypatch.setattr(server.engine, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    batches = metrics(server)["ssdlocal_batches_total"]
    others = ThreadPoolExecutor(4)
    for i in range(3):  # with other requests (other settings, other seeds) arriving meanwhile
        noise = [
            others.submit(ask, server.client, p, chat=False, stream=False, max_tokens=8, temperature=t, seed=s)
            for p, t, s in ((PROMPTS[i], 0.9, None), (PROMPTS[i + 3], 0.0, None), (prompt, 0.9, 99))
        ]
        got = ask(server.client, prompt, chat=False, stream=False, max_tokens=12, temperature=0.9, seed=1234)
        assert got["ids"] == expected["token_ids"], i
        for future in noise:
            future.result(timeout=120)
    others.shutdown()
    server.settle()  # every call counted (after its answers) before the next test
    assert metrics(server)["ssdlocal_batches_total"] >= batches + len(calls)


# ----------------------------------------------------------------------------- cancellation
def test_a_client_that_disconnects_cancels_its_rows(server):
    before = metrics(server)
    n = 120
    other = ThreadPoolExecutor(1).submit(
        ask, server.client, PROMPTS[2], chat=False, stream=True, max_tokens=n, ignore_eos=True
    )
    stream = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    received = 0
    for chunk in stream:
        received += sum(len(c.text) for c in chunk.choices)
        if received >= 3:
            break
    stream.close()  # the client leaves mid-answer
    finished = other.result(timeout=120)  # the request that stayed goes on to its end
    assert finished["stats"]["batch_size"] == 2  # both shared one batch
    deadline = time.monotonic() + 60
    while (after := metrics(server))["ssdlocal_requests_running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    key = "ssdlocal_requests_total{endpoint=completions,status=cancelled}"
    assert after[key] == before.get(key, 0) + 1
    # the engine stopped the cancelled row early: far fewer than its n tokens were made
    made = after["ssdlocal_generation_tokens_total"] - before["ssdlocal_generation_tokens_total"]
    assert n <= made < n + n // 2, made
    # and the row that stayed got exactly what it gets alone
    alone = ask(server.client, PROMPTS[2], chat=False, stream=False, max_tokens=n, ignore_eos=True)
    assert finished["ids"] == alone["ids"] and len(alone["ids"]) == n


# ----------------------------------------------------------------------------- errors
def _assert_error_body(body: dict, status: int, expected_status: int, param: str | None = None) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


def test_bad_requests_get_openai_error_bodies_and_the_server_goes_on(server):
    good = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"model": "gpt-4", "prompt": "Hello"}).encode(), 404, "model"),
        (json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "Hello", "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL, "prompt": "Hello " * 600, "max_tokens": 4}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "Hello", "logprobs": 21}).encode(), 400, "logprobs"),
        (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": [5, 10**6], "max_tokens": 2}).encode(), 400, "prompt"),
    ]
    for data, expected, param in cases:
        status, body = server.post("/v1/completions", data)
        _assert_error_body(body, status, expected, param)
        status, body = server.post("/v1/completions", good)  # the next request still succeeds
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    status, body = server.post("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
    _assert_error_body(body, status, 400, "messages")
    too_long = json.dumps({"model": MODEL, "prompt": "Hello " * 600}).encode()  # no max_tokens
    status, body = server.post("/v1/completions", too_long)
    _assert_error_body(body, status, 400, "prompt")
    assert body["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:  # the official client sees the same
        server.client.completions.create(model="nope", prompt="Hello", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=-1)
    status, body = server.get("/v1/nowhere")
    _assert_error_body(json.loads(body), status, 404)
    assert ask(server.client, "Hello", chat=True, stream=True, max_tokens=4)["usage"].completion_tokens == 4


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == server.engine.context
    assert server.get("/health")[0] == 200


# ----------------------------------------------------------------------------- metrics
def test_metrics_parse_as_prometheus_text_and_move(server):
    server.settle()  # an earlier test's last batch may still be counting
    before = metrics(server)
    ask(server.client, PROMPTS[1], chat=False, stream=False, max_tokens=12, ignore_eos=True)
    ask(server.client, PROMPTS[1], chat=True, stream=True, max_tokens=12, ignore_eos=True)
    server.settle()  # a batch is counted when its seating ends, just after the answer was sent
    after = metrics(server)
    for endpoint in ("completions", "chat"):
        key = f"ssdlocal_requests_total{{endpoint={endpoint},status=ok}}"
        assert after[key] == before.get(key, 0) + 1
    assert after["ssdlocal_generation_tokens_total"] == before["ssdlocal_generation_tokens_total"] + 24
    assert after["ssdlocal_prompt_tokens_total"] > before["ssdlocal_prompt_tokens_total"]
    assert after["ssdlocal_batches_total"] == before["ssdlocal_batches_total"] + 2
    assert after["ssdlocal_tokens_per_second"] > 0
    assert after["ssdlocal_verify_seconds_total"] > before["ssdlocal_verify_seconds_total"]
    assert after["ssdlocal_request_duration_seconds_count"] == before["ssdlocal_request_duration_seconds_count"] + 2
    assert after[f"ssdlocal_info{{mode={server.mode},model={MODEL},version={__import__('ssdlocal').__version__}}}"] == 1
    waits = "ssdlocal_host_waits_total{model=target}"
    assert after[waits] > before.get(waits, 0)  # the round's read-back, at least
    assert 0 < after["ssdlocal_host_waits_per_round{model=target}"] <= 1.5  # one per round (+ the first token's)
    assert after["ssdlocal_draft_losses_total"] == before["ssdlocal_draft_losses_total"] == 0
    if server.mode != "ar":
        assert after["ssdlocal_spec_decode_draft_tokens_total"] > before["ssdlocal_spec_decode_draft_tokens_total"]
        assert 0 <= after["ssdlocal_acceptance_rate"] <= 1
        assert after["ssdlocal_mean_accepted_len"] >= 1
        assert after["ssdlocal_draft_seconds_total"] > before["ssdlocal_draft_seconds_total"]
    if server.mode == "ssd":
        hits_misses = after["ssdlocal_ssd_cache_hits_total"] + after["ssdlocal_ssd_cache_misses_total"]
        assert hits_misses > before["ssdlocal_ssd_cache_hits_total"] + before["ssdlocal_ssd_cache_misses_total"]


# ----------------------------------------------------------------------------- shapes, failures
def test_several_prompts_and_n_choices(server):
    if server.mode != "ar":
        pytest.skip("request shapes do not depend on the mode")
    reply = server.client.completions.create(
        model=MODEL,
        prompt=PROMPTS[:2],
        n=2,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    ids = [c.model_extra["token_ids"] for c in reply.choices]
    assert ids[0] == ids[1] and ids[2] == ids[3]  # greedy: the n choices of a prompt agree
    for prompt, got in zip(PROMPTS[:2], (ids[0], ids[2])):
        assert got == ask(server.client, prompt, chat=False, stream=False, max_tokens=6, ignore_eos=True)["ids"]
    assert reply.usage.completion_tokens == 24
    assert reply.model_extra["ssdlocal"]["batch_size"] == 4
    assert reply.model_extra["ssdlocal"]["same_every_run"] is True  # torch keeps each row's tokens its own


def test_the_engine_survives_a_failed_request(server, monkeypatch):
    if server.mode == "sd":
        pytest.skip("AR and SSD cover the failure path")
    feed = server.engine.runner.feed
    calls = []

    def fail_once(rows, logits="all", progress=None):
        if not calls:
            calls.append(1)
            raise RuntimeError("simulated device failure")
        return feed(rows, logits, progress)

    monkeypatch.setattr(server.engine.runner, "feed", fail_once)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    status, reply = server.post("/v1/completions", body)
    _assert_error_body(reply, status, 500)
    assert "simulated device failure" in reply["error"]["message"] and reply["error"]["type"] == "server_error"
    calls.clear()  # and once more while streaming: an error event the client raises
    with pytest.raises(openai.APIError, match="simulated device failure"):
        list(server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True))
    got = ask(server.client, "Hello", chat=False, stream=True, max_tokens=4)
    assert len(got["ids"]) == 4 and got["finish"] == "length"
    assert server.get("/health")[0] == 200


# ----------------------------------------------------------------------------- prefix cache
def test_settled_waits_for_the_seating_after_its_answer(server, monkeypatch):
    """An answer leaves before its seating ends (stores its prefixes, is counted): the
    scheduler is not settled until then, so a test that waits for it sees the stored state."""
    import ssdlocal.engine.batch as batch

    server.settle()
    release, real = threading.Event(), batch.store_prefixes
    monkeypatch.setattr(batch, "store_prefixes", lambda *a: release.wait(30) and real(*a))
    before = metrics(server)["ssdlocal_batches_total"]
    ask(server.client, PROMPTS[3], chat=False, stream=False, max_tokens=4)
    assert not server.scheduler.settled
    assert metrics(server)["ssdlocal_batches_total"] == before
    release.set()
    server.settle()
    assert metrics(server)["ssdlocal_batches_total"] == before + 1


def test_a_conversation_reuses_its_history_and_reports_cached_tokens(server):
    """A chat's next turn re-sends the history: the server reads only what follows the
    prefix the engine kept, says so in usage.prompt_tokens_details.cached_tokens (streamed
    in the usage chunk too) and in /metrics, and the answer equals one without the cache."""
    server.settle()  # an earlier test's last batch may still be counting
    before = metrics(server)
    system = {"role": "system", "content": " ".join(PROMPTS)}
    history = [system, {"role": "user", "content": "Explain the first line."}]
    prompts, cached = [], []
    for turn in range(3):
        reply = server.client.chat.completions.create(
            model=MODEL,
            messages=history,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        for chunk in reply:
            for choice in chunk.choices:
                text += choice.delta.content or ""
            usage = chunk.usage or usage
        prompts.append(usage.prompt_tokens)
        cached.append(usage.prompt_tokens_details.cached_tokens)
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And line {turn + 2}?"}]
    assert cached[0] == 0
    for turn in (1, 2):  # the earlier turn's prompt, but a partial block and a re-rendered tail
        assert cached[turn] >= 0.7 * prompts[turn - 1], (cached, prompts)
    final = [{"role": m["role"], "content": m["content"]} for m in history[:-1]]
    with_cache = server.client.chat.completions.create(model=MODEL, messages=final, max_tokens=8, temperature=0)
    server.settle()  # the answer can leave before its seating has stored its prefixes
    server.engine.forget_prefixes()  # the engine thread is idle now
    fresh = server.client.chat.completions.create(model=MODEL, messages=final, max_tokens=8, temperature=0)
    assert with_cache.usage.prompt_tokens_details.cached_tokens > 0
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert with_cache.choices[0].message.content == fresh.choices[0].message.content
    assert fresh.model_extra["ssdlocal"]["prefill_tokens_per_s"] > 0
    server.settle()
    after = metrics(server)
    assert after["ssdlocal_prefix_cache_hit_tokens_total"] - before["ssdlocal_prefix_cache_hit_tokens_total"] >= sum(
        cached
    )
    assert after["ssdlocal_prefill_tokens_total"] > before["ssdlocal_prefill_tokens_total"]
    assert after["ssdlocal_prefix_cache_used_tokens"] > 0
