"""``phalanx bench serve``: load-test any OpenAI-compatible endpoint the way vLLM's and
SGLang's serving benchmarks do.

Requests (random ISL/OSL, shared-prefix groups, multi-turn conversations that resend their
history, or a JSONL of prompts) are sent at a Poisson rate with a burstiness factor, or as fast
as a concurrency limit allows, streaming. Reported: TTFT, TPOT, ITL and E2E (mean, median,
p99), request and output-token throughput, goodput under --goodput SLOs, and the share of
prompt tokens the server reported as cached — as JSON with every setting, a console table and
a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from phalanx.argtypes import NON_NEGATIVE, POSITIVE, above, at_least, ratio
from phalanx.bench.datasets import (
    BenchRequest,
    jsonl_requests,
    multi_turn_requests,
    random_requests,
    shared_prefix_requests,
)
from phalanx.bench.metrics import request_latencies, summarize


@dataclass
class Record:
    start: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 0.5, "tpot": 0.05} (milliseconds in, seconds out)."""
    out = {}
    for s in specs or []:
        key, _, ms = s.partition(":")
        if key not in ("ttft", "tpot", "itl", "e2e") or not ms:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS, itl:MS or e2e:MS, got {s!r}")
        out[key] = float(ms) / 1000.0
    return out


def is_good(lat: dict[str, Any], slo: dict[str, float]) -> bool:
    for key, limit in slo.items():
        v = max(lat["itl"]) if key == "itl" and lat["itl"] else lat.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if v > limit:
            return False
    return True


def summarize_run(records: list[Record], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    """The report's numbers from per-request records (pure arithmetic; tested)."""
    ok = [r for r in records if r.ok]
    lats = [request_latencies(r.start, r.token_times) for r in ok]
    for r, lat in zip(ok, lats, strict=True):   # TPOT over tokens, even when a chunk carried several
        if r.completion_tokens > 1:
            lat["tpot"] = (lat["e2e"] - lat["ttft"]) / (r.completion_tokens - 1)
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(1 for lat in lats if is_good(lat, slo)) if slo else None
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration if duration > 0 else 0.0,
        "goodput_req_s": good / duration if good is not None and duration > 0 else None,
        "cached_token_share": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": summarize([lat["ttft"] for lat in lats], 1e3),
        "tpot_ms": summarize([lat["tpot"] for lat in lats if not math.isnan(lat["tpot"])], 1e3),
        "itl_ms": summarize([x for lat in lats for x in lat["itl"]], 1e3),
        "e2e_ms": summarize([lat["e2e"] for lat in lats], 1e3),
        "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


class Client:
    def __init__(self, base_url: str, model: str, api: str, api_key: str | None, ignore_eos: bool,
                 temperature: float) -> None:
        import httpx
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=4096))
        self.base, self.model, self.api = base_url.rstrip("/"), model, api
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ignore_eos, self.temperature = ignore_eos, temperature

    async def send(self, req: BenchRequest, messages: list[dict] | None = None) -> tuple[Record, str]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len, "stream": True,
                                "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "chat":
            body["messages"] = messages or [{"role": "user", "content": req.text or ""}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = req.prompt_ids if req.prompt_ids is not None and req.text is None else req.text
            path = "/v1/completions"
        rec, text = Record(time.perf_counter()), ""
        try:
            async with self.http.stream("POST", self.base + path, json=body, headers=self.headers) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return rec, text
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if obj.get("usage"):
                        u = obj["usage"]
                        rec.completion_tokens, rec.prompt_tokens = u["completion_tokens"], u["prompt_tokens"]
                        rec.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for ch in obj.get("choices", []):
                        piece = ch.get("text") if self.api == "completions" else (ch.get("delta") or {}).get("content")
                        # a completion chunk comes with new tokens, even ones with no text of their
                        # own (ids past the tokenizer's vocabulary, a partial character): timed too,
                        # but not a closing chunk that only carries the finish reason
                        if piece or (self.api == "completions" and ch.get("finish_reason") is None):
                            rec.token_times.append(time.perf_counter())
                            text += piece or ""
        except Exception as e:  # a failed request is counted, not fatal
            rec.error = f"{type(e).__name__}: {e}"
        return rec, text

    async def close(self) -> None:
        await self.http.aclose()


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between sends: Gamma(shape=burstiness, mean=1/rate) (burstiness 1 = Poisson)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run(client: Client, requests: list[BenchRequest] | list[list[BenchRequest]], rate: float,
              burstiness: float, concurrency: int | None, seed: int, progress: bool,
              decode=None) -> tuple[list[Record], float]:
    sem = asyncio.Semaphore(concurrency or 1 << 30)
    records: list[Record] = []
    total = sum(len(x) if isinstance(x, list) else 1 for x in requests)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc="requests", dynamic_ncols=True)

    async def one(req: BenchRequest, messages=None) -> str:
        async with sem:
            rec, text = await client.send(req, messages)
        records.append(rec)
        if bar:
            bar.update(1)
        return text

    async def conversation(turns: list[BenchRequest]) -> None:
        messages: list[dict] = []
        for t in turns:
            messages.append({"role": "user", "content": t.text if t.text is not None else decode(t.prompt_ids)})
            reply = await one(t, list(messages))
            messages.append({"role": "assistant", "content": reply})

    tasks = []
    t0 = time.perf_counter()
    for item, gap in zip(requests, arrival_gaps(len(requests), rate, burstiness, seed), strict=True):
        await asyncio.sleep(gap)
        job = conversation(item) if isinstance(item, list) else one(item)  # type: ignore[arg-type]  # one request
        tasks.append(asyncio.ensure_future(job))
    await asyncio.gather(*tasks)
    if bar:
        bar.close()
    return records, time.perf_counter() - t0


def served_model(ap: argparse.ArgumentParser, base_url: str, api_key: str | None) -> str:
    """The server's model (its /v1/models); a server that is not there or refuses the key is a
    usage error naming --base-url or --api-key."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        ap.error(f"--base-url {base_url}: no server answers ({e})")
    if r.status_code in (401, 403):
        ap.error(f"--api-key: the server refused it ({r.status_code})")
    try:
        return str(r.json()["data"][0]["id"]) if r.status_code == 200 else ap.error(
            f"--base-url {base_url}: /v1/models answered {r.status_code}: {r.text[:200]}")
    except (ValueError, KeyError, IndexError, TypeError):
        ap.error(f"--base-url {base_url}: /v1/models names no model ({r.text[:200]}); pass --model")


def need_matplotlib(ap: argparse.ArgumentParser) -> None:
    """--plot draws with matplotlib, which phalanx does not install: said before the run, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        ap.error("--plot needs matplotlib (pip install matplotlib)")


def plot(records: list[Record], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in records if r.ok]
    lats = [request_latencies(r.start, r.token_times) for r in ok]
    fig, ax = plt.subplots(1, 4, figsize=(18, 3.8))
    ax[0].hist([lat["ttft"] * 1e3 for lat in lats], bins=40)
    ax[0].set_title("TTFT (ms)")
    ax[1].hist([x * 1e3 for lat in lats for x in lat["itl"]], bins=60)
    ax[1].set_title("ITL (ms)")
    ax[2].hist([lat["e2e"] * 1e3 for lat in lats], bins=40)
    ax[2].set_title("E2E latency (ms)")
    if ok:
        t0 = min(r.start for r in ok)
        times = sorted(t - t0 for r in ok for t in r.token_times)
        if times:
            width = max(0.25, times[-1] / 60)
            bins = [i * width for i in range(int(times[-1] / width) + 2)]
            counts = [0] * len(bins)
            for t in times:
                counts[int(t / width)] += 1
            ax[3].plot(bins, [c / width for c in counts])
    ax[3].set_title("output chunks/s over time")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _tokenizer(name: str | None):
    from phalanx.llmapi.tokenizer import load_tokenizer
    from phalanx.models.source import resolve_model
    return load_tokenizer(resolve_model(name))


def build_requests(a: argparse.Namespace, vocab: int, decode) -> list:
    if a.dataset == "random":
        reqs = random_requests(a.num_prompts, a.input_len, a.output_len, a.range_ratio, vocab, a.seed)
    elif a.dataset == "shared-prefix":
        reqs = shared_prefix_requests(a.groups, a.prompts_per_group, a.system_len, a.question_len, a.output_len,
                                      vocab, a.seed)
    elif a.dataset == "multi-turn":
        return multi_turn_requests(a.num_prompts, a.turns, a.input_len, a.question_len, a.output_len, vocab, a.seed)
    else:
        return jsonl_requests(a.jsonl, a.output_len, a.num_prompts)
    if a.api == "chat" or a.prompt_format == "text":
        for r in reqs:
            r.text = decode(r.prompt_ids)
    return reqs


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="phalanx bench serve", description=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--tokenizer", default=None, help="tokenizer for text prompts (default: the bundled model's)")
    ap.add_argument("--dataset", choices=["random", "shared-prefix", "multi-turn", "jsonl"], default="random")
    ap.add_argument("--jsonl", default=None)
    ap.add_argument("--num-prompts", type=POSITIVE, default=100, help="requests (conversations for multi-turn)")
    ap.add_argument("--input-len", type=POSITIVE, default=256)
    ap.add_argument("--output-len", type=POSITIVE, default=64)
    ap.add_argument("--range-ratio", type=ratio, default=0.0)
    ap.add_argument("--groups", type=POSITIVE, default=8)
    ap.add_argument("--prompts-per-group", type=POSITIVE, default=8)
    ap.add_argument("--system-len", type=NON_NEGATIVE, default=512)
    ap.add_argument("--question-len", type=POSITIVE, default=64)
    ap.add_argument("--turns", type=POSITIVE, default=4)
    ap.add_argument("--prompt-format", choices=["ids", "text"], default="ids")
    ap.add_argument("--request-rate", type=above(0.0), default=float("inf"))
    ap.add_argument("--burstiness", type=above(0.0), default=1.0)
    ap.add_argument("--max-concurrency", type=POSITIVE, default=None)
    ap.add_argument("--warmup", type=NON_NEGATIVE, default=2)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=at_least(0.0, float), default=0.0)
    ap.add_argument("--goodput", nargs="*", default=None, help="SLOs, e.g. ttft:500 tpot:50 (milliseconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None, help="JSON report")
    ap.add_argument("--plot", default=None, help="PNG of latency distributions and throughput")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if a.dataset == "jsonl" and not a.jsonl:
        ap.error("--dataset jsonl needs --jsonl FILE")
    if a.plot:
        need_matplotlib(ap)
    model = a.model or served_model(ap, a.base_url, a.api_key)
    tok = _tokenizer(a.tokenizer)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    reqs = build_requests(a, tok.vocab_size, decode)
    slo = parse_goodput(a.goodput)

    async def go():
        client = Client(a.base_url, model, a.api, a.api_key, a.ignore_eos, a.temperature)
        try:
            if a.warmup:
                warm = random_requests(a.warmup, 16, 4, 0.0, tok.vocab_size, seed=a.seed + 1)
                for w in warm:
                    w.text = decode(w.prompt_ids)
                await run(client, warm, float("inf"), 1.0, None, a.seed, False, decode)
            return await run(client, reqs, a.request_rate, a.burstiness, a.max_concurrency, a.seed,
                             not a.no_progress, decode)
        finally:
            await client.close()

    records, duration = asyncio.run(go())
    summary = summarize_run(records, duration, slo)
    settings = {k: v for k, v in vars(a).items() if k != "api_key"}
    settings.update({"model": model, "request_rate": str(a.request_rate)})
    report = {"settings": settings, "results": summary}
    print_table(summary)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(report, f, indent=2)
    if a.plot:
        plot(records, a.plot, f"{model} · {a.dataset} · rate {a.request_rate} · concurrency {a.max_concurrency}")
    return 0 if summary["completed"] else 1


def print_table(s: dict[str, Any]) -> None:
    print(f"{'completed / failed':32s} {s['completed']} / {s['failed']}")
    print(f"{'duration (s)':32s} {s['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':32s} {s['request_throughput']:.2f}")
    print(f"{'output throughput (tok/s)':32s} {s['output_throughput']:.1f}")
    if s["goodput_req_s"] is not None:
        print(f"{'goodput (req/s)':32s} {s['goodput_req_s']:.2f}")
    print(f"{'cached prompt-token share':32s} {s['cached_token_share']:.3f}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = s[key]
        label = key[:-3].upper() + " (ms) mean / median / p99"
        print(f"{label:32s} {m['mean']:.1f} / {m['median']:.1f} / {m['p99']:.1f}")
