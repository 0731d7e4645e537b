"""Time a multi-turn conversation against a running `ssdlocal serve`, as a chat client sees it.

    ssdlocal serve &                     # every default (or the flags you want to measure)
    python scripts/session_ttft.py --url http://127.0.0.1:8000/v1 [--session review-scheduler]

Uses the official `openai` client: a system message holding a source file (the packaged
`--prompts session` workload of `ssdlocal bench`), then each question in turn, the history
re-sent every turn with the answers the server gave; streamed, temperature 0, `max_tokens`
48. Prints per turn: prompt tokens, `usage.prompt_tokens_details.cached_tokens`, the share
of the previous turn's prompt it covers, time to the first streamed token (client side),
the turn's whole time, and the server's own `ttft_s` / `prefill_tokens_per_s`.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> int:
    from openai import OpenAI

    from ssdlocal.bench.prompts import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--session", default="review-scheduler", help="a session id of the session workload")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    turns = sorted((p for p in load_prompts("session") if p.session == args.session), key=lambda p: p.turn)
    if not turns:
        raise SystemExit(f"no session {args.session!r} in the session workload")
    client = OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    history = [{"role": "system", "content": turns[0].system}]
    rows, previous = [], None
    for turn in turns:
        history.append({"role": "user", "content": turn.prompt})
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        first, text, usage, stats = None, "", None, {}
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content and first is None:
                    first = time.perf_counter() - t0
                text += choice.delta.content or ""
            usage = chunk.usage or usage
            stats = (chunk.model_extra or {}).get("ssdlocal") or stats
        total = time.perf_counter() - t0
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        rows.append(
            {
                "turn": turn.turn,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": cached,
                "covers_previous": None if previous is None else cached / previous,
                "ttft_s": first,
                "turn_s": total,
                "server_ttft_s": stats.get("ttft_s"),
                "prefill_tokens_per_s": stats.get("prefill_tokens_per_s"),
                "mode": stats.get("mode"),
            }
        )
        previous = usage.prompt_tokens
        history.append({"role": "assistant", "content": text})
    if args.as_json:
        print(json.dumps({"model": model, "session": args.session, "turns": rows}, indent=1))
        return 0
    base = rows[0]["ttft_s"] or float("nan")
    print("| turn | prompt tokens | cached tokens | of previous prompt | TTFT s | vs turn 1 | turn s | prefill tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cover = "–" if r["covers_previous"] is None else f"{r['covers_previous']:.0%}"
        rate = "–" if not r["prefill_tokens_per_s"] else f"{r['prefill_tokens_per_s']:.0f}"
        print(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {cover} | {r['ttft_s']:.2f} | "
            f"{r['ttft_s'] / base:.2f}x | {r['turn_s']:.2f} | {rate} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
