"""SGLang's native generation routes on ``phalanx serve``, for RL trainers that drive a rollout
engine through them (slime, AReaL, verl's HTTP adapter):

    POST /generate        {"text" | "input_ids", "sampling_params", "return_logprob", "stream", "rid", "lora_path", ...}
    POST /abort_request   {"rid": str} | {"abort_all": true}
    GET  /v1/loads        ?include=core,memory,spec,lora,disagg,queues,all &dp_rank=N   (each rank's requests, KV use)
    GET  /get_load        (the older form: [{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}])
    GET  /get_model_info  {"model_path", "tokenizer_path", "is_generation", "weight_version", ...}  (routers check
                          a worker's model by it)
    GET  /get_server_info (also /server_info) the settings SGLang's clients read ("context_length", "tp_size",
                          "dp_size", "page_size", "max_total_num_tokens", ...), "version", and each rank's
                          "internal_states"

A request is one prompt (a string, or a list of token ids) or a batch (a list of either; its
``sampling_params`` one dict for all or one per prompt). The answer to one prompt is

    {"text": the output's text, "output_ids": its token ids (a stop or EOS token included),
     "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                   "weight_version", "e2e_latency", [logprobs]}}

and to a batch, or to ``n`` > 1, a list of them, prompt by prompt, each prompt's samples in
order. ``finish_reason`` is SGLang's dict: ``{"type": "length", "length": n}``, ``{"type":
"stop", "matched": token id | stop string}`` or ``{"type": "abort", "message": ...}`` (an
aborted request answers 200 with its tokens so far, so a trainer keeps a partial rollout). With
``return_logprob`` the meta_info holds ``output_token_logprobs`` ([logprob, token id, text or
null] a token), with ``top_logprobs_num`` > 0 ``output_top_logprobs``, and with
``logprob_start_len`` >= 0 the prompt's from that position (``input_token_logprobs``, the first
token's logprob null). A stream sends an event a step for each prompt and sample (``index``
says which), each with all of its output so far (SGLang's default), then ``data: [DONE]``.

The sampling fields are SGLang's names mapped onto phalanx's ``SamplingParams`` (``max_new_tokens``
128 by default, ``temperature`` 1.0, ``top_k`` -1 for all, ``no_stop_trim`` keeps a matched stop
string, ``json_schema``/``regex``/``ebnf``/``structural_tag`` one constraint); any other field
is refused by name. ``spaces_between_special_tokens`` is taken either way: phalanx's tokenizers
are fast ones, whose decoding does not put spaces between special tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import Field, SkipValidation, field_validator, model_validator

from phalanx import __version__
from phalanx.llmapi.outputs import RequestOutput
from phalanx.llmapi.sampling_params import MAX_LOGPROBS, GuidedDecodingParams, SamplingParams, plain_token_ids
from phalanx.serve.protocol import BodyError, NullIsDefault, Strict, parse_body

if TYPE_CHECKING:
    from phalanx.serve.openai_server import OpenAIServer

MAX_BATCH = 1024        # prompts in one /generate (each a request of the engine)
MAX_SEQUENCES = 4096    # prompts times samples in one /generate
MAX_NEW_TOKENS_DEFAULT = 128   # SGLang's


class NativeSampling(NullIsDefault):
    """SGLang's ``sampling_params`` (names and defaults as SGLang's)."""

    max_new_tokens: int | None = Field(MAX_NEW_TOKENS_DEFAULT, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)   # -1: every token (0 is refused, as SGLang's)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None

    def params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """phalanx's SamplingParams of these (ValueError naming the field). The logprobs are
        SGLang's: of the logits divided by the temperature (``scaled_logprobs``)."""
        given = (("json", self.json_schema), ("regex", self.regex), ("grammar", self.ebnf),
                 ("structural_tag", self.structural_tag))
        constraints: dict[str, Any] = {k: v for k, v in given if v is not None}
        guided = GuidedDecodingParams(**constraints) if constraints else None
        bias = None
        if self.logit_bias:
            if not all(k.isascii() and k.isdigit() and len(k) <= 10 for k in self.logit_bias):
                raise ValueError("logit_bias keys must be token ids written as decimal integers")
            bias = {int(k): v for k, v in self.logit_bias.items()}
        greedy = self.temperature < 1e-6     # SGLang's: a temperature this low is greedy
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_new_tokens, temperature=0.0 if greedy else self.temperature,
            top_p=None if self.top_p == 1.0 else self.top_p, top_k=None if self.top_k in (-1, 0) else self.top_k,
            min_p=self.min_p or None, n=self.n, seed=self.sampling_seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.no_stop_trim, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs, scaled_logprobs=True,
            guided_decoding=guided, skip_special_tokens=self.skip_special_tokens)

    @model_validator(mode="after")
    def _one_constraint(self) -> NativeSampling:
        given = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one of json_schema, regex, ebnf and structural_tag, got {given}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens})")
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (every token) or at least 1")
        return self


class GenerateBody(NullIsDefault):
    text: SkipValidation[str | list[str] | None] = None
    input_ids: SkipValidation[list[int] | list[list[int]] | None] = None
    sampling_params: NativeSampling | list[NativeSampling] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | None = None      # SGLang's: the name of a LoRA adapter the server serves

    @field_validator("text", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) and v:
            return v
        if isinstance(v, list) and v and len(v) <= MAX_BATCH and all(isinstance(t, str) and t for t in v):
            return v
        raise ValueError(f"must be a non-empty string or a list of 1 to {MAX_BATCH} non-empty strings")

    @field_validator("input_ids", mode="before")
    @classmethod
    def _ids(cls, v: Any) -> Any:
        def ids(x: Any) -> bool:   # (the vocabulary's bound is checked with the prompts)
            return isinstance(x, list) and (plain_token_ids(x) or bool(x) and all(type(t) is int and t >= 0
                                                                                for t in x))
        if v is None or ids(v) or isinstance(v, list) and v and len(v) <= MAX_BATCH and all(ids(x) for x in v):
            return v
        raise ValueError(f"must be a non-empty list of token ids, or a list of 1 to {MAX_BATCH} of them")

    @model_validator(mode="after")
    def _one_input(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text or input_ids: give exactly one of them")
        n = len(self.prompts)
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != n:
            raise ValueError(f"sampling_params: a list needs one per prompt ({n}), got {len(self.sampling_params)}")
        if isinstance(self.rid, list) and len(self.rid) != n:
            raise ValueError(f"rid: a list needs one per prompt ({n}), got {len(self.rid)}")
        if isinstance(self.rid, list) and len(set(self.rid)) != n:
            raise ValueError("rid: the ids of a batch must differ")
        samples = sum(self.sampling(i).n for i in range(n))
        if samples > MAX_SEQUENCES:
            raise ValueError(f"sampling_params: at most {MAX_SEQUENCES} prompts times samples, got {samples}")
        return self

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        if self.text is not None:
            return self.text if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None
        return self.input_ids if isinstance(self.input_ids[0], list) else [self.input_ids]

    def sampling(self, i: int) -> NativeSampling:
        sp = self.sampling_params
        return sp[i] if isinstance(sp, list) else sp or NativeSampling()

    def rids(self) -> list[str]:
        n = len(self.prompts)
        if isinstance(self.rid, list):
            return self.rid
        base = self.rid or uuid.uuid4().hex
        return [base] if n == 1 else [f"{base}_{i}" for i in range(n)]


class AbortBody(NullIsDefault):
    """SGLang's: ``rid`` ("" for none) or ``abort_all`` (which wins); neither aborts nothing."""

    rid: str = ""
    abort_all: bool = False


def add_routes(server: OpenAIServer) -> None:
    app = server.app
    from phalanx.serve.openai_server import ApiError, _abort, _merge, _sse
    running: dict[str, list[RequestOutput]] = {}     # a /generate request's rid -> its engine requests

    async def body(request: Request, model: type[Strict]) -> Any:
        try:
            return parse_body(await request.body(), model)
        except BodyError as e:
            raise ApiError(400, e.message, e.param) from None

    @app.post("/generate")
    async def generate(request: Request):
        b: GenerateBody = await body(request, GenerateBody)
        started = time.monotonic()
        try:
            server._check_model(b.lora_path)
        except ApiError as e:
            raise ApiError(400, e.message.replace("The model", "lora_path: the adapter", 1), "lora_path") from None
        what = "text" if b.text is not None else "input_ids"
        try:
            if b.text is not None:
                prompts = await server._text(server._prompts, b.prompts, False)
            else:
                prompts = server._prompts(b.prompts, False)
        except ApiError as e:     # (named as a completion's prompt: here the field is text or input_ids)
            raise ApiError(e.status, e.message.replace("prompt", what, 1), what) from None
        logprobs = b.top_logprobs_num if b.return_logprob else None
        jobs = []
        for i, (_, ids) in enumerate(prompts):
            s = b.sampling(i)
            limit = server._output_limit(len(ids), s.max_new_tokens if s.max_new_tokens != 0 else 1, what,
                                         "sampling_params.max_new_tokens")
            # the prompt's logprobs only where some are asked for (a request with them reuses no cached prefix)
            prompt_lp = b.top_logprobs_num if b.return_logprob and 0 <= b.logprob_start_len < len(ids) else None
            try:
                sp = s.params(limit, logprobs, prompt_lp)
            except ValueError as e:
                raise ApiError(400, f"sampling_params: {e}", "sampling_params") from None
            await server._check_grammar(sp, "sampling_params")
            jobs.append((ids, sp))
        rids = b.rids()
        busy = next((r for r in rids if r in running), None)
        if busy is not None:
            raise ApiError(400, f"rid {busy!r} is already running", "rid")
        futs = server._submit_all(jobs, None, what)
        for rid, fut in zip(rids, futs, strict=True):
            running[rid] = [fut]
        items = [(i, k) for i, (_, sp) in enumerate(jobs) for k in range(sp.n)]   # prompt by prompt, then samples
        first = [0]
        for _, sp in jobs:
            first.append(first[-1] + sp.n)     # each prompt's first item

        def answer(i: int, k: int, out: RequestOutput) -> dict[str, Any]:
            nothing = b.sampling(i).max_new_tokens == 0     # SGLang's prompt-only request (a cache fill)
            return _answer(server, b, rids[i] if len(items) == len(rids) else f"{rids[i]}_{k}", out, k, started,
                           nothing)

        if b.stream:
            async def events() -> AsyncIterator[str]:
                try:
                    async for i, out in _merge(futs):
                        if isinstance(out, Exception):
                            yield _sse({"error": {"message": f"generation failed: {out}"}})
                            break
                        for o in out.outputs:
                            if o.text_diff or o.token_ids_diff or o.finish_reason is not None:
                                event = answer(i, o.index, out)
                                if b.batched or len(items) > 1:
                                    event["index"] = first[i] + o.index
                                yield _sse(event)
                    for f in futs:
                        server._observe(f)
                    yield "data: [DONE]\n\n"
                finally:
                    for rid in rids:
                        running.pop(rid, None)
            return StreamingResponse(server._counting_aborts(events()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            outs = await server._collect(futs, request)
        finally:
            for rid in rids:
                running.pop(rid, None)
        for out in outs:
            server._observe(out)
        answers = [answer(i, k, outs[i]) for i, k in items]
        return answers if b.batched or len(answers) > 1 else answers[0]

    @app.post("/abort_request")
    async def abort_request(request: Request):
        b: AbortBody = await body(request, AbortBody)
        futs = list(server._in_flight) if b.abort_all else running.get(b.rid, []) if b.rid else []
        left = [f for f in futs if not f.done]
        _abort(left)
        aborted = len(left)
        return {"success": True, "aborted": aborted}

    def rank_loads(include: set[str]) -> list[dict[str, Any]]:
        args = server.llm.args
        if not server.llm.is_alive:
            raise ApiError(503, f"the engine is not running: {server.llm.dead_error}")
        stats = server.llm.latest_stats()
        if not stats:
            raise ApiError(503, "the engine has not reported its load yet")
        counted = sum(s.get("num_running", 0) + s.get("num_waiting", 0)
                      for s in (stats if args.enable_attention_dp else stats[:1]))
        held = sum(1 for f in list(server._in_flight) if not f.done)
        return loads(stats, args.enable_attention_dp, args.kv_cache_config.tokens_per_block, args.max_batch_size,
                     include, max(0, held - counted))

    @app.get("/v1/loads")
    async def v1_loads(include: str = "all", dp_rank: int | None = None, format: str = "json"):
        """SGLang's load report (slime polls it after ``abort_all`` until no request is left)."""
        asked = {p.strip() for p in include.split(",") if p.strip()}
        bad = sorted(asked - {*LOAD_SECTIONS, "all"})
        if bad:
            raise ApiError(400, f"include: one or more of {', '.join(LOAD_SECTIONS)} or all, got {bad[0]!r}",
                           "include")
        if format != "json":
            raise ApiError(400, "format: only json is served (the same counters are on /metrics for Prometheus)",
                           "format")
        entries = rank_loads(set(LOAD_SECTIONS) if "all" in asked or not asked else asked)
        if dp_rank is not None:
            if not 0 <= dp_rank < len(entries):
                raise ApiError(400, f"dp_rank: {dp_rank} is not a rank of this server (0 to {len(entries) - 1})",
                               "dp_rank")
            entries = entries[dp_rank:dp_rank + 1]
        running = sum(e["num_running_reqs"] for e in entries)
        waiting = sum(e["num_waiting_reqs"] for e in entries)
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
                "dp_rank_count": len(entries), "loads": entries,
                "aggregate": {"total_running_reqs": running, "total_waiting_reqs": waiting,
                              "total_reqs": running + waiting,
                              "total_used_tokens": sum(e["num_used_tokens"] for e in entries),
                              "total_tokens": sum(e["max_total_num_tokens"] for e in entries),
                              "avg_token_usage": sum(e["token_usage"] for e in entries) / len(entries)}}

    @app.get("/get_model_info")
    async def get_model_info():
        """SGLang's model card of the worker (what a router checks before it sends requests)."""
        llm, cfg = server.llm, server.llm.source.config
        return {"model_path": llm.args.model, "tokenizer_path": llm.args.tokenizer or llm.args.model,
                "served_model_name": server.model_name, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": llm.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": cfg.model_type,
                "architectures": list(getattr(cfg, "architectures", None) or [])}

    generated = [time.monotonic(), 0.0]   # (when, tokens generated) at the last /get_server_info

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info():
        """SGLang's server info: the settings its clients read under SGLang's names, the version,
        and each data-parallel rank's load as its ``internal_states`` (SGLang's
        ``last_gen_throughput``: output tokens a second since the previous call, spread over the
        ranks; ``memory_usage.token_capacity``; ``avg_spec_accept_length`` under speculation).
        ``dp_size`` is 1: with attention DP phalanx places requests on its ranks itself, so a
        router sees one worker (``enable_dp_attention`` and ``attention_dp_size`` say it)."""
        args = server.llm.args
        try:
            entries = rank_loads({"core", "spec"})
        except ApiError:   # no heartbeat yet, or the engine down: the settings still answer
            entries = []
        now, total = time.monotonic(), server.metrics.generated_tokens()
        rate = (total - generated[1]) / max(1e-9, now - generated[0])
        generated[:] = [now, total]
        for e in entries:
            e["last_gen_throughput"] = rate / len(entries)
            e["memory_usage"] = {"token_capacity": e["max_total_num_tokens"]}
            if "speculative" in e:
                e["avg_spec_accept_length"] = e["speculative"]["accept_length"]
        spec = args.speculative_config
        return {"model_path": args.model, "tokenizer_path": args.tokenizer or args.model,
                "served_model_name": server.model_name, "context_length": server.llm.max_seq_len,
                "max_req_input_len": server.llm.max_seq_len - 1, "tp_size": args.tensor_parallel_size, "dp_size": 1,
                "enable_dp_attention": args.enable_attention_dp,
                "attention_dp_size": args.tensor_parallel_size if args.enable_attention_dp else 1,
                "ep_size": args.moe_expert_parallel_size or 1,
                "page_size": args.kv_cache_config.tokens_per_block, "max_running_requests": args.max_batch_size,
                "chunked_prefill_size": args.max_num_tokens if args.enable_chunked_prefill else -1,
                "max_prefill_tokens": args.max_num_tokens,
                "disable_radix_cache": not args.kv_cache_config.enable_block_reuse,
                "enable_lora": args.lora is not None, "max_loras_per_batch": args.lora.max_loras if args.lora else None,
                "speculative_algorithm": {"NGram": "NGRAM", "DraftTarget": "STANDALONE",
                                          "Eagle3": "EAGLE3"}[spec.decoding_type]
                if spec is not None else None,
                "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_config.dtype,
                "max_total_num_tokens": entries[0]["max_total_num_tokens"] if entries else None,
                "weight_version": server.llm.weight_version, "version": __version__,
                "internal_states": entries}

    @app.get("/get_load")
    async def get_load():
        """SGLang's older load report, as routers that balance by it read it."""
        return [{"dp_rank": e["dp_rank"], "num_reqs": e["num_total_reqs"], "num_waiting_reqs": e["num_waiting_reqs"],
                 "num_tokens": e["num_used_tokens"]} for e in rank_loads({"core"})]


LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues")


def loads(stats: list[dict[str, Any]], attention_dp: bool, tokens_per_block: int, max_batch_size: int,
          include: set[str], unseen: int = 0) -> list[dict[str, Any]]:
    """SGLang's ``/v1/loads`` entries from the ranks' heartbeat stats: one a data-parallel rank
    (with attention DP every rank holds requests of its own; otherwise rank 0's batch is every
    rank's), the core counts always and the sections ``include`` names. ``unseen``: requests
    the server holds that no heartbeat counts yet (submitted since the last one, or waiting for
    attention DP to place them), counted as waiting on rank 0. ``disagg`` adds nothing (phalanx
    does not split prefill from decode); ``lora`` the adapter slots holding one (0 of 0 without
    LoRA); ``memory`` gives
    the KV pool's token capacity."""
    out = []
    for rank, st in enumerate(stats if attention_dp else stats[:1]):
        running, waiting = st.get("num_running", 0), st.get("num_waiting", 0) + (unseen if rank == 0 else 0)
        used = (st.get("num_blocks", 0) - st.get("num_available_blocks", 0)) * tokens_per_block
        queried = st.get("prefix_queried_tokens", 0)
        entry: dict[str, Any] = {
            "dp_rank": rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting, "num_used_tokens": used,
            "max_total_num_tokens": st.get("num_blocks", 0) * tokens_per_block,
            "token_usage": st.get("kv_usage", 0.0), "max_running_requests": max_batch_size,
            "cache_hit_rate": st.get("prefix_hit_tokens", 0) / queried if queried else 0.0}
        if "memory" in include:
            entry["memory"] = {"token_capacity": entry["max_total_num_tokens"]}
        if "spec" in include and st.get("spec_verify_rows"):
            accepted = st.get("spec_accepted_drafts", 0)
            entry["speculative"] = {"accept_length": 1 + accepted / st["spec_verify_rows"],
                                    "accept_rate": accepted / max(1, st.get("spec_draft_tokens", 0))}
        if "lora" in include:
            used, total = st.get("lora_slots_used", 0), st.get("lora_slots_total", 0)
            entry["lora"] = {"slots_used": used, "slots_total": total, "utilization": used / total if total else 0.0}
        if "queues" in include:
            entry["queues"] = {"waiting": waiting}
        out.append(entry)
    return out


def _answer(server: OpenAIServer, b: GenerateBody, rid: str, out: RequestOutput, k: int, started: float,
            nothing: bool) -> dict[str, Any]:
    """One prompt's (one sample's) answer as SGLang gives it: all of its output so far."""
    o = out.outputs[k]
    ids, text = ([], "") if nothing else (o.token_ids, o.text)
    finish = None if not o.finish_reason else (
        {"type": "length", "length": 0} if nothing and o.finish_reason in ("length", "stop") else
        _finish(o.finish_reason, o.stop_reason, ids))
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": finish,
        "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(ids),
        "cached_tokens": out.cached_tokens, "weight_version": out.weight_version}
    if o.finish_reason:
        meta["e2e_latency"] = time.monotonic() - started
    if b.return_logprob:
        name = server._token_str if b.return_text_in_logprobs else None
        entries = [] if nothing else (o.logprobs or [])[:len(ids)]
        meta["output_token_logprobs"] = [_triple(e[t].logprob, t, name) for t, e in zip(ids, entries, strict=True)]
        meta["output_token_logprobs_length"] = len(entries)
        start = b.logprob_start_len if b.logprob_start_len >= 0 else len(out.prompt_token_ids)
        prompt = list(zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False))[start:]
        meta["input_token_logprobs"] = [_triple(None if e is None else e[t].logprob, t, name) for t, e in prompt]
        if b.top_logprobs_num:
            meta["output_top_logprobs"] = [_top(e, b.top_logprobs_num, name) for e in entries]
            meta["input_top_logprobs"] = [None if e is None else _top(e, b.top_logprobs_num, name) for _, e in prompt]
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def _finish(reason: str, stop: int | str | None, ids: list[int]) -> dict[str, Any]:
    """SGLang's finish reason of an output that ended: a stop names what it matched (a stop
    string, a stop token, or EOS as its id: the output's last token)."""
    if reason == "length":
        return {"type": "length", "length": len(ids)}
    if reason == "stop":
        return {"type": "stop", "matched": stop if stop is not None else (ids[-1] if ids else None)}
    return {"type": "abort", "message": "the request was aborted" if reason == "abort" else "generation failed"}


def _triple(logprob: float | None, token_id: int, name: Any) -> list[Any]:
    return [logprob, token_id, name(token_id) if name is not None else None]


def _top(entry: dict[int, Any], k: int, name: Any) -> list[list[Any]]:
    """A position's k likeliest tokens, likeliest first (the chat logprobs' ``_alternatives``),
    as SGLang lists them."""
    from phalanx.serve.openai_server import _alternatives
    return [_triple(x.logprob, t, name) for t, x in _alternatives(entry, k)]