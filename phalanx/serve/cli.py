"""``phalanx serve [MODEL]``: trtllm-serve's flags, plus --api-key. The YAML of
--extra_llm_api_options (alias --config) may set any LLM field and wins over flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shlex
import socket
import sys
from typing import Any

from phalanx.argtypes import POSITIVE, at_least, port
from phalanx.config import LORA_TARGETS
from phalanx.serve.tools import PARSERS

logger = logging.getLogger("phalanx")


class DefaultsHelp(argparse.HelpFormatter):
    """``phalanx serve --help`` with each flag's default, where it has one and its help does not
    already say it (an API key from the environment is never printed: its help names the variable)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory, .gguf file or HF id (default: bundled SmolLM2)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8000, help="port to listen on")
    p.add_argument("--backend", default="pytorch", choices=["pytorch"], help="the engine")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks (under mpirun)")
    p.add_argument("--ep_size", type=int, default=None, help="expert-parallel ranks of a MoE model")
    p.add_argument("--max_batch_size", type=int, default=None, help="requests in one step (default: the engine's)")
    p.add_argument("--max_num_tokens", type=int, default=None, help="tokens in one step (default: the engine's)")
    p.add_argument("--max_seq_len", type=int, default=None, help="prompt + output tokens (default: the model's)")
    p.add_argument("--kv_cache_free_gpu_memory_fraction", type=float, default=None,
                   help="share of the free GPU memory the KV cache takes (default: the engine's)")
    p.add_argument("--kv_cache_dtype", "--kv-cache-dtype", dest="kv_cache_dtype", default=None,
                   choices=["auto", "fp8", "fp8_e4m3", "bfloat16", "float16"],
                   help="the KV pool's dtype (kv_cache_config.dtype; fp8_e4m3 is fp8)")
    p.add_argument("--kv_offloading_size", "--kv-offloading-size", dest="kv_offloading_size", type=float, default=None,
                   help="GiB of host memory for KV blocks the GPU pool evicts, summed over the ranks (vLLM's flag; "
                        "kv_cache_config.host_cache_size is each rank's share in bytes)")
    p.add_argument("--kv_offloading_backend", "--kv-offloading-backend", dest="kv_offloading_backend", default=None,
                   choices=["native"], help="vLLM's flag: native, phalanx's own host tier (needs --kv-offloading-size)")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8", "modelopt", "compressed-tensors"],
                   help="fp8: the projections quantized to FP8 at load (an FP8 checkpoint is served in FP8 anyway); "
                        "modelopt, compressed-tensors: the checkpoint's own method")
    p.add_argument("--speculative_config", "--speculative-config", dest="speculative_config", type=json_mapping,
                   default=None, help="speculative decoding as JSON: decoding_type NGram/DraftTarget/Eagle3, or "
                                      "vLLM's method ngram/draft_model/eagle3 with num_speculative_tokens")
    p.add_argument("--enable_lora", "--enable-lora", dest="enable_lora", action="store_true",
                   help="serve LoRA adapters (lora_config's defaults unless --max_loras/--max_lora_rank or the YAML "
                        "set them); implied by --lora_modules")
    p.add_argument("--lora_modules", "--lora-modules", dest="lora_modules", nargs="+", type=lora_module, default=None,
                   help="adapters served as models of their own: NAME=PATH (a PEFT directory) or vLLM's JSON "
                        '{"name": ..., "path": ...}; a request names one as its model')
    p.add_argument("--lora_paths", "--lora-paths", dest="lora_paths", nargs="+", type=lora_path, default=None,
                   help="SGLang's spelling of --lora_modules: NAME=PATH, PATH (named by itself) or JSON "
                        '{"lora_name": ..., "lora_path": ..., "pinned": false}')
    p.add_argument("--allow_runtime_lora_updating", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (the server then reads adapter "
                        "directories its clients name); implies --enable_lora")
    p.add_argument("--max_loras", "--max-loras", "--max-loras-per-batch", dest="max_loras", type=POSITIVE,
                   default=None, help="adapters one step may run (lora_config.max_loras; SGLang's "
                                      "--max-loras-per-batch)")
    p.add_argument("--max_lora_rank", "--max-lora-rank", dest="max_lora_rank", type=POSITIVE, default=None,
                   help="the largest adapter rank served (lora_config.max_lora_rank)")
    p.add_argument("--max_cpu_loras", "--max-cpu-loras", "--max-loaded-loras", dest="max_cpu_loras", type=POSITIVE,
                   default=None, help="adapters kept in host memory when no request uses them "
                                      "(lora_config.max_cpu_loras; SGLang's --max-loaded-loras)")
    p.add_argument("--lora_target_modules", "--lora-target-modules", dest="lora_target_modules", nargs="+",
                   choices=[*LORA_TARGETS, "all"], default=None,
                   help="the projections that hold adapter slots (lora_config.lora_target_modules; all: every one)")
    p.add_argument("--extra_llm_api_options", "--config", dest="config", default=None, help="YAML of LLM arguments")
    p.add_argument("--api-key", "--api_key", dest="api_key", default=os.environ.get("PHALANX_API_KEY"),
                   help="the key clients must send (default: $PHALANX_API_KEY; none: no key asked)")
    p.add_argument("--trust_remote_code", action="store_true", help="let the model's code run (tokenizers)")
    p.add_argument("--chat_template", default=None,
                   help="a Jinja chat template: a file, or the template itself (checked at start-up)")
    p.add_argument("--trust-request-chat-template", "--trust_request_chat_template", action="store_true",
                   dest="trust_request_chat_template",
                   help="render a chat request's own chat_template (vLLM's flag; without it such a request is refused)")
    p.add_argument("--served_model_name", default=None, help="the model's name in the API (default: the model's)")
    p.add_argument("--log_level", default="info", type=str.lower, choices=list(LOG_LEVELS), help="log level")
    p.add_argument("--drain_timeout", type=at_least(0.0, float), default=30.0,
                   help="seconds in-flight requests get on SIGTERM; those left are then aborted (finish reason "
                        "abort; their answers get 5 s more) and later ones refused (503)")
    p.add_argument("--max_request_body_bytes", type=POSITIVE, default=8 << 20,
                   help="the largest request body taken (413 above)")
    p.add_argument("--tool_call_parser", default="auto", choices=["auto", *PARSERS],
                   help="how tool calls are read from free-running output (auto: by the chat template)")
    p.add_argument("--responses_store_size", type=at_least(0, int), default=1024,
                   help="responses kept in memory for previous_response_id and GET /v1/responses/{id}, the newest "
                        "first (also bounded by their text); 0: none are kept")
    p.add_argument("--reasoning_parser", default="none", choices=["none", "qwen3", "deepseek_r1"],
                   help="split <think> blocks into reasoning_content")
    p.add_argument("--engine_iteration_timeout", type=float, default=None,
                   help="seconds without progress from the ranks before the engine is declared stalled (0: off)")
    p.add_argument("--allowed_origins", "--allowed-origins", dest="allowed_origins", type=origins, default=None,
                   help="origins whose browser pages may call the server, comma-separated or a JSON list (CORS; "
                        "'*' for any): off by default, so that a page the user visits cannot reach a server that "
                        "takes no key")
    p.add_argument("--enable_debug_endpoints", action="store_true",
                   help="serve /debug/check_integrity and /debug/stats (KV integrity and engine counters per rank)")


# seconds the handlers of requests aborted when the drain time is over have to send their answer
# before uvicorn cancels what is left (an abort reaches every rank and comes back within a step)
ABORT_GRACE = 5.0
# uvicorn's levels, and the level of phalanx's own logger at each
LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO", "debug": "DEBUG",
              "trace": "DEBUG"}


def chat_template(value: str) -> str:
    """``--chat_template``: a file's contents, or (as vLLM) the template itself; compiled here, so
    that a template that does not parse stops start-up instead of failing every chat request."""
    if os.path.isfile(value):
        with open(value) as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat_template: {value!r} is neither a file nor a Jinja template")
    import jinja2
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat_template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text


def compile_template(text: str) -> None:
    """Compile a chat template as transformers does when it renders one (its extensions, such as
    ``{% generation %}``, included); a sandboxed environment with loop controls where its
    compiler is not there."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        return
    _compile_jinja_template(text)


def url_host(host: str) -> str:
    """A host as a URL holds it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


_ORIGIN = re.compile(r"\*|[a-z][a-z0-9+.-]*://[^/\s]+")


def origins(value: str) -> list[str]:
    """``--allowed-origins``: "https://a,https://b" or vLLM's '["https://a"]'; each a scheme and a
    host (a trailing slash never matches a browser's Origin header, so it is refused)."""
    try:
        items = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    items = [str(x).strip() for x in items]
    bad = [x for x in items if not _ORIGIN.fullmatch(x)]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else value!r} is not an origin ('*' or scheme://host[:port], "
                                         "no path)")
    return items


def json_mapping(value: str) -> dict[str, Any]:
    """A flag's JSON object (``--speculative-config '{"method": "ngram", ...}'``, as vLLM takes it)."""
    try:
        d = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {value!r}")
    return d


def lora_module(value: str) -> tuple[str, str]:
    """``--lora_modules``: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}."""
    if value.lstrip().startswith("{"):
        try:
            d = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        extra = sorted(set(d) - {"name", "path"}) if isinstance(d, dict) else []
        if not isinstance(d, dict) or extra or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise argparse.ArgumentTypeError("expected {\"name\": ..., \"path\": ...}"
                                             + (f" ({extra[0]} is not supported)" if extra else ""))
        return adapter_dir(d["name"], d["path"])
    name, sep, path = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return adapter_dir(name, path)


def adapter_dir(name: str, path: str) -> tuple[str, str]:
    """An adapter's name and its directory, which must hold a PEFT ``adapter_config.json`` (so
    that a model named after the flag is not taken for one of its adapters)."""
    if not name or not path:
        raise argparse.ArgumentTypeError(f"{name}={path}: the name and the path must not be empty")
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is not a directory (a PEFT adapter's)")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise argparse.ArgumentTypeError(f"{path!r} holds no adapter_config.json (a PEFT adapter's directory); the "
                                         "model goes before the adapter flags")
    return name, path


def lora_path(value: str) -> tuple[str, str]:
    """``--lora_paths`` (SGLang's): NAME=PATH, PATH alone (its own name), or JSON {"lora_name":
    ..., "lora_path": ..., "pinned": ...}; ``pinned: true`` (never evicted from the GPU's slots) is
    refused: phalanx's slots go to the adapters the running requests use."""
    if value.lstrip().startswith("{"):
        try:
            d = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        extra = sorted(set(d) - {"lora_name", "lora_path", "pinned"}) if isinstance(d, dict) else []
        if not isinstance(d, dict) or extra or not isinstance(d.get("lora_name"), str) \
                or not isinstance(d.get("lora_path"), str):
            raise argparse.ArgumentTypeError('expected {"lora_name": ..., "lora_path": ...}'
                                             + (f" ({extra[0]} is not supported)" if extra else ""))
        if d.get("pinned") not in (None, False):
            raise argparse.ArgumentTypeError("pinned: adapters are not pinned to GPU slots here (the slots go to "
                                             "the adapters running requests use); leave it out or false")
        return adapter_dir(d["lora_name"], d["lora_path"])
    return lora_module(value if "=" in value else f"{value}={value}")


def lora_requests(modules: list[tuple[str, str]] | None) -> dict[str, Any]:
    """``--lora_modules`` as the server's adapters, ids 1, 2, ... in the order given."""
    from phalanx.llmapi.lora_request import LoRARequest
    out: dict[str, Any] = {}
    for i, (name, path) in enumerate(modules or (), start=1):
        if name in out:
            raise ValueError(f"--lora_modules/--lora-paths: {name!r} is given twice")
        out[name] = LoRARequest(name, i, path)
    return out


def llm_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    from phalanx.config import merge_yaml
    kw: dict[str, Any] = {"tokenizer": a.tokenizer, "tensor_parallel_size": a.tp_size,
                          "moe_expert_parallel_size": a.ep_size, "max_batch_size": a.max_batch_size,
                          "max_num_tokens": a.max_num_tokens, "max_seq_len": a.max_seq_len,
                          "trust_remote_code": a.trust_remote_code or None,
                          "engine_iteration_timeout": a.engine_iteration_timeout, "quantization": a.quantization,
                          "speculative_config": a.speculative_config,
                          # vLLM's host tier: shared out over the ranks once the YAML has had its say
                          "kv_offloading_size": a.kv_offloading_size, "kv_offloading_backend": a.kv_offloading_backend}
    kv = {"free_gpu_memory_fraction": a.kv_cache_free_gpu_memory_fraction,
          "dtype": "fp8" if a.kv_cache_dtype == "fp8_e4m3" else a.kv_cache_dtype}
    kw["kv_cache_config"] = {k: v for k, v in kv.items() if v is not None} or None
    targets = a.lora_target_modules
    lora = {"max_loras": a.max_loras, "max_lora_rank": a.max_lora_rank, "max_cpu_loras": a.max_cpu_loras,
            "lora_target_modules": list(LORA_TARGETS) if targets and "all" in targets else targets}
    kw["lora_config"] = {k: v for k, v in lora.items() if v is not None} or None
    kw["enable_lora"] = a.enable_lora or bool(a.lora_modules or a.lora_paths) or a.allow_runtime_lora_updating or None
    kw = {k: v for k, v in kw.items() if v is not None}
    if a.config:
        kw = merge_yaml(kw, a.config)
    return kw


def instructions(host: str, port: int, model: str, api_key: str | None) -> str:
    """A curl command and an openai one-liner that call the server, quoted for a POSIX shell
    whatever the key and the model's name hold."""
    url = f"http://{url_host(host)}:{port}"
    auth = f" -H {shlex.quote('Authorization: Bearer ' + api_key)}" if api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    code = (f"from openai import OpenAI; c = OpenAI(base_url={repr(url + '/v1')}, "
            f"api_key={repr(api_key or 'unused')}); print(c.chat.completions.create(model={repr(model)}, "
            f"messages=[{{\"role\": \"user\", \"content\": \"Hello!\"}}], max_tokens=32).choices[0].message.content)")
    return (f"phalanx serve: {model} on {url}\n\n"
            f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f"    -d {shlex.quote(body)}\n\n"
            f"  python -c {shlex.quote(code)}\n")


def serve(a: argparse.Namespace) -> int:
    import uvicorn

    from phalanx import LLM
    from phalanx.serve.openai_server import OpenAIServer
    logging.getLogger("phalanx").setLevel(LOG_LEVELS[a.log_level])
    try:
        template = chat_template(a.chat_template) if a.chat_template else None
        kwargs = llm_kwargs(a)
        adapters = lora_requests((a.lora_modules or []) + (a.lora_paths or []))
    except Exception as e:   # a missing or malformed file, a YAML that does not parse
        print(f"phalanx serve: {e}", file=sys.stderr)
        return 1
    model = kwargs.pop("model", a.model)     # the YAML's model wins over the argument, as its other keys
    try:   # the port first: a taken port is reported at once, and no engine port can take it
        sock = listen_socket(a.host, a.port)
    except OSError as e:
        print(f"phalanx serve: cannot listen on {a.host}:{a.port} (--host/--port): {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        llm = LLM(model, **kwargs)
    except KeyboardInterrupt:   # Ctrl-C while the engine starts (LLM takes its job down)
        sock.close()
        print("phalanx serve: interrupted while the engine started", file=sys.stderr)
        return 130
    except Exception as e:
        sock.close()
        print(f"phalanx serve: the engine did not start: {e}", file=sys.stderr)
        return 1
    try:   # every adapter read as the ranks will: one that cannot be served stops start-up
        from phalanx.serve.lora_routes import check_adapter
        for adapter in adapters.values():
            check_adapter(llm, adapter.lora_name, adapter.lora_path)
    except ValueError as e:
        sock.close()
        llm.shutdown()
        print(f"phalanx serve: --lora_modules/--lora-paths: {e}", file=sys.stderr)
        return 1
    name = a.served_model_name or (llm.source.name if model else "SmolLM2-135M-Instruct")
    server = OpenAIServer(llm, name, a.api_key, template, a.max_request_body_bytes, a.enable_debug_endpoints,
                          tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
                          allowed_origins=a.allowed_origins, responses_store_size=a.responses_store_size,
                          lora_modules=adapters, runtime_lora_updating=a.allow_runtime_lora_updating,
                          trust_request_chat_template=a.trust_request_chat_template)
    # uvicorn cancels the handlers still running when its graceful time is over, mid-response; the
    # requests still running when the drain time is over are aborted first, and their handlers
    # get ABORT_GRACE seconds more to answer (finish reason "abort") before uvicorn cancels any
    config = uvicorn.Config(server.app, host=a.host, port=a.port, log_level=a.log_level,
                            timeout_graceful_shutdown=a.drain_timeout + ABORT_GRACE, access_log=False)
    userver = uvicorn.Server(config)
    original = userver.startup
    original_shutdown = userver.shutdown

    async def shutdown(*args: Any, **kw: Any) -> None:
        drained = asyncio.get_running_loop().call_later(a.drain_timeout, server.abort_in_flight)
        try:
            await original_shutdown(*args, **kw)
        finally:
            drained.cancel()

    async def startup(*args: Any, **kw: Any) -> None:
        await original(*args, **kw)
        print(instructions(a.host, a.port, name, a.api_key), flush=True)
        print(f"  pid {os.getpid()}: SIGTERM drains the requests in flight (up to {a.drain_timeout:g} s; then "
              "those left are aborted), then stops\n", flush=True)

    userver.startup = startup  # type: ignore[method-assign]
    userver.shutdown = shutdown  # type: ignore[method-assign]
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal into the handler that was
    # there before it: make that a no-op so a drained server shuts the engine down and exits 0.
    import signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        userver.run(sockets=[sock])
    finally:
        llm.shutdown()
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), for uvicorn to listen on. Its protocol is named
    (IPPROTO_TCP, not 0): asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets
    that say so, and with Nagle on, a stream's first event waits for the client to acknowledge
    the response headers — up to 40 ms of delayed ACK added to the time to first token."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
