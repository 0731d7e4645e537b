"""Agent requests against a running `ssdlocal serve`, through the official openai client.

    ssdlocal serve --target-backend torch --mode sd &      # any mode / draft
    python scripts/agent_check.py --url http://127.0.0.1:8000/v1 --label sd --out sd.json

Checks (exit code 1 if one fails): `tool_choice: "required"` (one call: parallel_tool_calls
false) returns a call of the offered
function whose arguments validate against its schema; a `json_schema` answer validates; a
full tool round trip (call, `tool` result, final answer) ends with a text answer. Timings:
the same request constrained and not, `--repeats` times each, interleaved, greedy:
  - tool call: tool_choice "required" (a grammar) vs "auto" (the model answers by itself:
    the small built-in pair writes the call as a ```json block, which stays text);
  - JSON: response_format json_schema vs the same prompt without it.
Prints one JSON object (tokens/s medians from the server's own `ssdlocal` stats, acceptance,
grammar ms per token) and writes it to --out. Needs `openai` and `jsonschema`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

WEATHER = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    }
]
TOOL_ASK = [{"role": "user", "content": "What's the weather like in Paris right now, in celsius?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "birth_year": {"type": "integer"},
        "city": {"type": "string"},
        "occupations": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "birth_year", "city", "occupations"],
    "additionalProperties": False,
}
JSON_ASK = [
    {
        "role": "user",
        "content": "Extract the person from: 'Ada Lovelace, born 1815 in London, was a "
        "mathematician and writer.' Reply with JSON only, with the keys name, birth_year, city and "
        "occupations (a list).",
    }
]


def main() -> int:
    import jsonschema
    import openai

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--label", default="")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused", timeout=900, max_retries=0)
    model = client.models.list().data[0].id
    failures: list[str] = []

    def ask(**kw):
        t0 = time.perf_counter()
        res = client.chat.completions.create(
            model=model, temperature=0, max_tokens=args.max_tokens, extra_body={"return_token_ids": True}, **kw
        )
        return res, time.perf_counter() - t0

    # ---- checks
    res, _ = ask(messages=TOOL_ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    calls = res.choices[0].message.tool_calls or []
    call_ok = (
        bool(calls)
        and res.choices[0].finish_reason == "tool_calls"
        and all(c.function.name == "get_weather" and _valid(jsonschema, c.function.arguments, WEATHER) for c in calls)
    )
    if not call_ok:
        failures.append(f"tool_choice required: {res.choices[0].model_dump()}")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    res_json, _ = ask(messages=JSON_ASK, response_format=fmt)
    json_ok = res_json.choices[0].finish_reason == "stop" and _valid(
        jsonschema, res_json.choices[0].message.content, PERSON
    )
    if not json_ok:
        failures.append(f"json_schema: {res_json.choices[0].model_dump()}")
    trip_ok, final_text = False, None
    if calls:
        history = TOOL_ASK + [
            {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
            *(
                {
                    "role": "tool",
                    "tool_call_id": c.id,
                    "content": json.dumps(
                        {"location": "Paris", "temperature": 18, "unit": "celsius", "conditions": "light rain"}
                    ),
                }
                for c in calls
            ),
        ]
        final, _ = ask(messages=history, tools=TOOLS)
        final_text = final.choices[0].message.content
        trip_ok = (
            final.choices[0].finish_reason == "stop" and bool(final_text) and not final.choices[0].message.tool_calls
        )
        if not trip_ok:
            failures.append(f"round trip: {final.choices[0].model_dump()}")

    # ---- timings: constrained vs not, interleaved
    pairs = {
        "tool_call": (
            dict(messages=TOOL_ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
            dict(messages=TOOL_ASK, tools=TOOLS, tool_choice="auto"),
        ),
        "json": (dict(messages=JSON_ASK, response_format=fmt), dict(messages=JSON_ASK)),
    }
    timings: dict[str, dict] = {}
    for name, (constrained, free) in pairs.items():
        runs: dict[str, list] = {"constrained": [], "unconstrained": []}
        for _ in range(args.repeats):
            for kind, kw in (("constrained", constrained), ("unconstrained", free)):
                res, wall = ask(**kw)
                stats = res.model_extra["ssdlocal"]
                runs[kind].append(
                    {
                        "tokens_per_s": stats["tokens_per_s"],
                        "tokens": res.usage.completion_tokens,
                        "acceptance_rate": stats.get("acceptance_rate"),
                        "mask_ms_per_token": stats.get("mask_ms_per_token"),
                        "wall_s": wall,
                        "ids": res.choices[0].model_extra.get("token_ids"),
                    }
                )
        timings[name] = {kind: _summary(rows) for kind, rows in runs.items()}
        timings[name]["same_tokens"] = runs["constrained"][0]["ids"] == runs["unconstrained"][0]["ids"]
        c, u = timings[name]["constrained"], timings[name]["unconstrained"]
        timings[name]["constrained_over_unconstrained"] = c["tokens_per_s"] / u["tokens_per_s"]
    out = {
        "label": args.label,
        "model": model,
        "checks": {"tool_choice_required": call_ok, "json_schema": json_ok, "round_trip": trip_ok},
        "call": [c.function.model_dump() for c in calls],
        "json_answer": res_json.choices[0].message.content,
        "final_answer": final_text,
        "timings": timings,
        "failures": failures,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if failures else 0


def _valid(jsonschema, text: str | None, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _summary(rows: list[dict]) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows) if all(r[key] is not None for r in rows) else None  # noqa: E731
    return {
        "tokens_per_s": med("tokens_per_s"),
        "tokens": med("tokens"),
        "acceptance_rate": med("acceptance_rate"),
        "mask_ms_per_token": med("mask_ms_per_token"),
        "runs": len(rows),
    }


if __name__ == "__main__":
    sys.exit(main())
