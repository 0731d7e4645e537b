"""`ssdlocal serve` for editors and OpenAI-style clients, end to end, with a tiny model whose
tokenizer has Qwen2.5-Coder's FIM tokens (suffix drafting on):

- /v1/completions with `suffix` (official `openai` client) answers the model's own FIM
  prompt, token for token what `generate --fim-suffix` gives at temperature 0;
- llama.cpp's /infill (input_prefix, input_suffix, input_extra, prompt) answers in
  llama.cpp's shape, whole and streamed, and a repeated editor context is served by the
  prefix cache (tokens_cached, usage.prompt_tokens_details.cached_tokens);
- a model without FIM tokens gets a 400 naming `suffix` / `input_suffix`;
- streamed usage comes as OpenAI sends it: only with stream_options.include_usage, only
  on the final chunk (no choices), so a client adding up chunks' usage (langchain,
  pydantic-ai, smolagents) counts the request once.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from support.cli import run_cli
from support.drafts import draft_of
from support.server import MODEL, LiveServer
from support.tiny_models import make_fim_checkpoint

from ssdlocal.core.config import EngineConfig, Mode, ModelSpec, SpecConfig

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py

BEFORE = "def fibonacci(n):\n    if n < 2:\n"
AFTER = "\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
EXTRA = [{"filename": "util.py", "text": "def helper():\n    return 1\n"}]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    return make_fim_checkpoint(tmp_path_factory.mktemp("fim"), "qwen")


@pytest.fixture(scope="module")
def server(fim_model):
    config = EngineConfig(
        target=ModelSpec(str(fim_model), dtype="float32"),
        spec=SpecConfig(mode=Mode.SD, k=3, draft=draft_of("suffix")),
        pin_cpus=False,
    )
    live = LiveServer(config)
    yield live
    live.close()


def _post(live: LiveServer, path: str, body: dict) -> tuple[int, dict]:
    return live.post(path, json.dumps(body).encode())


def _stream(live: LiveServer, path: str, body: dict) -> list:
    """The server-sent events of a streamed request, as parsed JSON (`[DONE]` as is)."""
    req = urllib.request.Request(
        f"{live.url}{path}", data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _completion(live: LiveServer, **extra):
    return live.client.completions.create(
        model=MODEL,
        prompt=BEFORE,
        suffix=AFTER,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **extra,
    )


# ----------------------------------------------------------------------------- /v1/completions + suffix
def test_completion_with_suffix_is_the_models_fim_prompt(server, fim_model, monkeypatch, capsys):
    reply = _completion(server)
    choice = reply.choices[0]
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "generate",
        BEFORE,
        "--fim-suffix",
        AFTER,
        "--target",
        fim_model,
        "--dtype",
        "float32",
        "--mode",
        "ar",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
    )
    assert code == 0, err
    expected = json.loads(out)["outputs"][0]
    assert choice.model_extra["token_ids"] == expected["token_ids"] and choice.text == expected["text"]
    from ssdlocal.engine.fim import fim_prompt, fim_tokens

    tok = server.engine.tokenizer
    assert reply.usage.prompt_tokens == len(fim_prompt(tok, fim_tokens(tok), BEFORE, AFTER))
    plain = server.client.completions.create(
        model=MODEL, prompt=BEFORE, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.usage.prompt_tokens < reply.usage.prompt_tokens  # the suffix and FIM tokens were read


def test_a_model_without_fim_tokens_refuses_suffix_naming_it(server, monkeypatch):
    monkeypatch.setattr(server.state, "fim", None)  # as for a tokenizer without FIM tokens
    with pytest.raises(openai.BadRequestError) as err:
        _completion(server)
    assert err.value.status_code == 400 and err.value.body["param"] == "suffix"
    assert "fill-in-the-middle" in err.value.body["message"]
    status, body = _post(server, "/infill", {"input_prefix": BEFORE, "input_suffix": AFTER})
    assert status == 400 and body["error"]["param"] == "input_suffix", body
    assert server.client.completions.create(model=MODEL, prompt=BEFORE, max_tokens=2).usage.completion_tokens == 2


def test_suffix_must_be_text_with_a_text_prompt(server):
    status, body = _post(server, "/v1/completions", {"model": MODEL, "prompt": BEFORE, "suffix": 3})
    assert status == 400 and body["error"]["param"] == "suffix"
    status, body = _post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "suffix": "x"})
    assert status == 400 and body["error"]["param"] == "suffix"


# ----------------------------------------------------------------------------- /infill
def test_infill_answers_in_llama_cpp_shape_and_reuses_the_editor_context(server):
    body = {
        "input_prefix": BEFORE,
        "input_suffix": AFTER,
        "input_extra": EXTRA,
        "prompt": "",
        "n_predict": 12,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": True,
        "samplers": ["top_k", "top_p", "infill"],
        "t_max_predict_ms": 500,
        "n_indent": 4,
    }
    status, first = _post(server, "/infill", body)
    assert status == 200, first
    assert first["stop"] is True and first["stop_type"] == "limit" and first["tokens_predicted"] == 12
    assert isinstance(first["content"], str) and first["has_new_line"] == ("\n" in first["content"])
    assert first["generation_settings"]["n_predict"] == 12 and first["generation_settings"]["temperature"] == 0
    timings = first["timings"]
    assert timings["predicted_n"] == 12 and timings["prompt_n"] + first["tokens_cached"] == first["tokens_evaluated"]
    from ssdlocal.engine.fim import ContextFile, fim_prompt, fim_tokens

    tok = server.engine.tokenizer
    ids = fim_prompt(tok, fim_tokens(tok), BEFORE, AFTER, extra=[ContextFile(**EXTRA[0])], repo_level=True)
    assert first["tokens_evaluated"] == len(ids)
    status, again = _post(server, "/infill", body)  # an editor asks again with the same context
    assert status == 200 and again["content"] == first["content"]
    assert again["tokens_cached"] > 0.7 * len(ids) and again["timings"]["prompt_n"] < timings["prompt_n"]
    events = _stream(server, "/infill", {**body, "stream": True})
    assert "[DONE]" not in events and all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == first["content"] and events[-1]["tokens_predicted"] == 12


def test_infill_equals_a_completion_with_suffix_of_the_same_prompt(server):
    """Without context files /infill still names the repository and file (llama.cpp's
    layout), so it is its own prompt; typed `prompt` text continues the prefix."""
    status, reply = _post(
        server,
        "/infill",
        {
            "input_prefix": BEFORE[:-4],
            "prompt": BEFORE[-4:],
            "input_suffix": AFTER,
            "n_predict": 6,
            "temperature": 0,
            "return_tokens": True,
            "ignore_eos": True,
        },
    )
    assert status == 200, reply
    from ssdlocal.engine.fim import fim_prompt, fim_tokens

    tok = server.engine.tokenizer
    ids = fim_prompt(tok, fim_tokens(tok), BEFORE, AFTER, repo_level=True)
    alone = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    assert reply["tokens"] == alone.choices[0].model_extra["token_ids"] and reply["content"] == alone.choices[0].text


def test_infill_validates_its_fields(server):
    for body, param in (
        ({"input_prefix": 3}, "input_prefix"),
        ({"input_extra": "x"}, "input_extra"),
        ({"input_extra": [{"text": 1}]}, "input_extra"),
        ({"n_predict": "5"}, "n_predict"),
        ({"temperature": -1}, "temperature"),
    ):
        status, reply = _post(server, "/infill", body)
        assert status == 400 and reply["error"]["param"] == param, (body, reply)


# ----------------------------------------------------------------------------- streamed usage
def _summed_usage(chunks) -> dict | None:
    """Usage as langchain-openai adds it: the sum over every chunk that carries one."""
    total = None
    for chunk in chunks:
        if chunk.usage is not None:
            u = chunk.usage
            total = total or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            total["prompt_tokens"] += u.prompt_tokens
            total["completion_tokens"] += u.completion_tokens
            total["total_tokens"] += u.total_tokens
    return total


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_streamed_usage_is_counted_once_as_openai_sends_it(server, chat):
    common = {"model": MODEL, "max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if chat:
        create = server.client.chat.completions.create
        common["messages"] = [{"role": "user", "content": "Say hi."}]
    else:
        create = server.client.completions.create
        common["prompt"] = "Hello there"
    whole = create(**common).usage
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **common))
    assert _summed_usage(chunks) == {
        "prompt_tokens": whole.prompt_tokens,
        "completion_tokens": 10,
        "total_tokens": whole.prompt_tokens + 10,
    }
    with_usage = [i for i, c in enumerate(chunks) if c.usage is not None]
    assert with_usage == [len(chunks) - 1] and chunks[-1].choices == []
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    assert chunks[-2].model_extra.get("ssdlocal") is not None  # the stats stay on the finish chunk
    plain = list(create(stream=True, **common))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_the_suffix_and_context_files_count_against_the_prompt_limit(server, monkeypatch):
    from ssdlocal.server.limits import ServerLimits

    monkeypatch.setattr(server.state, "limits", ServerLimits(max_prompt_chars=len(BEFORE) + 10))
    with pytest.raises(openai.BadRequestError) as err:
        _completion(server)  # the prompt fits, with the suffix it does not
    assert err.value.body["param"] == "suffix" and err.value.body["code"] == "context_length_exceeded"
    status, body = _post(server, "/infill", {"input_prefix": BEFORE, "input_extra": [{"text": "x" * 20}]})
    assert status == 400 and body["error"]["param"] == "input_suffix", body
