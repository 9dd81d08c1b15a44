"""`mpirun -n 2 phalanx launch -- phalanx serve --tp_size 2` answers; the snippets `phalanx
serve` prints work as printed."""

import shlex
import subprocess
import sys

import httpx
import pytest

from phalanx.serve.cli import instructions
from serve_helpers import start_launched_server, start_server, stop_launched_server, stop_server

MODEL = "SmolLM2-135M-Instruct"


def test_printed_curl_and_openai_snippet_work_as_printed():
    proc, url = start_server(key=None)
    try:
        port = int(url.rsplit(":", 1)[1])
        # a key with quotes and a dollar (this server takes no key, so any is let through) must
        # reach the server as it is: the snippets are quoted for the shell
        for key in (None, 'it\'s $ecret "x"'):
            text = instructions("127.0.0.1", port, MODEL, key)
            lines = [x.strip() for x in text.splitlines()]
            curl = " ".join(x.rstrip("\\").strip() for x in lines if x.startswith("curl") or x.startswith("-d"))
            out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
            assert '"choices"' in out.stdout and '"content"' in out.stdout, out.stdout + out.stderr
            snippet = next(x for x in lines if x.startswith("python -c"))
            res = subprocess.run(snippet.replace("python", shlex.quote(sys.executable), 1), shell=True,
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0 and res.stdout.strip(), res.stderr
            if key:
                assert shlex.split(snippet)[2].count(f"api_key={key!r}") == 1
                assert f"Authorization: Bearer {key}" in shlex.split(curl)
    finally:
        assert stop_server(proc) == 0


@pytest.mark.mpi
def test_serve_under_launch_with_tp2():
    proc, url = start_launched_server("--tp_size", "2", "--max_seq_len", "512", env={"OMPI_MCA_btl": "^tcp"})
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    finally:
        stop_launched_server(proc)


def test_a_taken_port_is_named_and_no_engine_starts():
    """The port is claimed before the engine starts: one already taken is reported with the flag
    that set it, exit code 1, and no engine comes up (nothing is left running)."""
    import socket

    from serve_helpers import phalanx_bin
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = subprocess.run([phalanx_bin(), "serve", "--port", str(port), "--log_level", "info"],
                             capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"cannot listen on 127.0.0.1:{port} (--host/--port)" in res.stderr, res.stderr
    assert "engine ready" not in res.stdout + res.stderr


def test_connections_to_the_listening_socket_send_without_nagle_delay():
    """The socket `phalanx serve` hands uvicorn: every connection accepted on it through asyncio
    (as uvicorn accepts) has TCP_NODELAY, so a stream's first event is not held back until the
    client acknowledges the response headers (a 40 ms delayed ACK on Linux clients)."""
    import asyncio
    import socket

    from phalanx.serve.cli import listen_socket

    async def accept_one() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = listen_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accept_one()) != 0


# a template that reads vLLM's documents and reasoning_effort (the bundled model's reads neither)
READING_TEMPLATE = (
    "{% if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% if documents %}<|im_start|>system\n{% for d in documents %}[{{ d.title }}] {{ d.text }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def custom_server(tmp_path_factory):
    """A server with --allowed-origins and a --chat_template of its own."""
    from serve_helpers import KEY
    template = tmp_path_factory.mktemp("template") / "reading.jinja"
    template.write_text(READING_TEMPLATE)
    proc, url = start_server("--allowed-origins", "http://app.example", "--chat_template", str(template), key=KEY)
    yield url
    assert stop_server(proc) == 0


def test_documents_and_reasoning_effort_reach_a_template_that_reads_them(custom_server):
    """vLLM's ``documents`` and ``reasoning_effort`` are rendered by a template that reads them
    (the bundled model's template reads neither, and refuses them: test_openai_client)."""
    from serve_helpers import KEY
    auth = {"Authorization": f"Bearer {KEY}"}
    ask = {"messages": [{"role": "user", "content": "What colour is the sky?"}],
           "documents": [{"title": "Doc1", "text": "The sky is green."}], "reasoning_effort": "high"}
    ids = httpx.post(custom_server + "/tokenize", json=ask, headers=auth, timeout=120).json()["tokens"]
    text = httpx.post(custom_server + "/detokenize", json={"tokens": ids}, headers=auth, timeout=120).json()["prompt"]
    assert "Reasoning: high" in text and "[Doc1] The sky is green." in text, text
    r = httpx.post(custom_server + "/v1/chat/completions", json={**ask, "max_tokens": 2}, headers=auth, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
    r = httpx.post(custom_server + "/v1/responses", headers=auth, timeout=120, json={
        "input": "What colour is the sky?", "reasoning": {"effort": "high"}, "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["reasoning"]["effort"] == "high", r.text
    twice = httpx.post(custom_server + "/v1/chat/completions", headers=auth, timeout=120, json={
        **ask, "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "reasoning_effort", twice.text


def test_browser_pages_reach_the_server_only_from_the_allowed_origins(custom_server):
    """CORS is off unless --allowed-origins names origins: a listed origin's preflight is answered
    without the key (browsers send none there) and its calls carry the allow header; any other
    origin gets neither. The shared server (no flag) answers no preflight."""
    from serve_helpers import KEY
    url = custom_server
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(url + "/v1/chat/completions", headers={"Origin": "http://app.example", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **pre})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    call = httpx.get(url + "/v1/models", headers={"Origin": "http://app.example", "Authorization": f"Bearer {KEY}"})
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "http://app.example"
    assert httpx.get(url + "/v1/models", headers={"Origin": "http://app.example"}).status_code == 401
    delete = httpx.options(url + "/v1/responses/resp_1", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "DELETE"})
    assert delete.status_code == 200 and "DELETE" in delete.headers["access-control-allow-methods"]
    proc, url = start_server(key=None)
    try:
        r = httpx.options(url + "/v1/chat/completions", headers={"Origin": "http://app.example", **pre})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = httpx.get(url + "/v1/models", headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        assert stop_server(proc) == 0


def test_the_allowed_origins_flag_takes_lists_and_refuses_what_no_browser_sends(capsys):
    import argparse

    from phalanx.serve.cli import add_serve_args
    p = argparse.ArgumentParser()
    add_serve_args(p)
    a = p.parse_args(["--allowed-origins", "https://a.example,http://b.example:8080", "Qwen/Qwen2.5-0.5B"])
    assert a.allowed_origins == ["https://a.example", "http://b.example:8080"] and a.model == "Qwen/Qwen2.5-0.5B"
    assert p.parse_args(["--allowed-origins", '["*"]']).allowed_origins == ["*"]     # vLLM's form
    for bad in ("https://a.example/", "a.example", '["https://a", 3]', "["):
        with pytest.raises(SystemExit):
            p.parse_args(["--allowed-origins", bad])
        assert "--allowed-origins" in capsys.readouterr().err


def test_serve_help_shows_the_defaults_and_never_the_api_key(capsys, monkeypatch):
    """``phalanx serve --help`` gives each flag's default where it has one (as vLLM's does), and
    an API key taken from the environment is named by its variable, never printed."""
    from phalanx.cli import main
    monkeypatch.setenv("PHALANX_API_KEY", "sk-do-not-print")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())    # the help's lines joined
    assert e.value.code == 0
    for shown in ("port to listen on (default: 8000)", "(default: 127.0.0.1)", "(default: 30.0)", "(default: info)",
                  "(default: auto)", "(default: 8388608)", "(default: $PHALANX_API_KEY"):
        assert shown in out, shown
    assert "sk-do-not-print" not in out and "(default: None)" not in out and "(default: False)" not in out


def test_serve_flags_refuse_values_out_of_range_by_name(capsys, tmp_path):
    """Ports outside 1-65535, a negative drain time or body limit and unknown log levels are
    usage errors naming the flag (exit 2), not tracebacks or a server that refuses every request;
    a chat template is a file or the template itself, and one that does not parse is refused
    before anything starts; an IPv6 host is bracketed in the printed URLs."""
    import argparse

    from phalanx.serve.cli import add_serve_args, chat_template
    p = argparse.ArgumentParser()
    add_serve_args(p)
    for flag, bad in (("--port", "70000"), ("--port", "-1"), ("--drain_timeout", "-3"),
                      ("--max_request_body_bytes", "-1"), ("--log_level", "loud")):
        with pytest.raises(SystemExit):
            p.parse_args([flag, bad])
        assert flag in capsys.readouterr().err
    assert p.parse_args(["--log_level", "TRACE"]).log_level == "trace"      # uvicorn's level, any case
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(inline)
    assert chat_template(str(tmp_path / "t.jinja")) == chat_template(inline) == inline
    masked = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert chat_template(masked) == masked       # transformers' own tags (assistant masks) parse
    for bad, needle in ((str(tmp_path / "none.jinja"), "neither a file"),
                        ("{% for m in messages %}{{ m }}", "not a valid Jinja template")):
        with pytest.raises(ValueError, match=needle):
            chat_template(bad)
    assert "http://[::1]:8000/v1" in instructions("::1", 8000, "m", None)


def test_the_config_yaml_may_name_the_model_and_a_bad_template_stops_start_up(tmp_path):
    """``model:`` in the --config YAML is the model served (the YAML wins over flags, the
    positional argument included); a template that does not parse exits 1 with the reason."""
    import argparse

    from phalanx.serve.cli import add_serve_args, llm_kwargs
    from serve_helpers import phalanx_bin
    (tmp_path / "c.yaml").write_text("model: /nowhere/model\nmax_batch_size: 4\n")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    kw = llm_kwargs(p.parse_args(["other", "--config", str(tmp_path / "c.yaml")]))
    assert kw["model"] == "/nowhere/model" and kw["max_batch_size"] == 4
    assert "kv_cache_config" not in kw and "speculative_config" not in kw and "quantization" not in kw
    # vLLM's flags for FP8 and speculation; the YAML's nested settings merge with them
    (tmp_path / "kv.yaml").write_text("kv_cache_config:\n  tokens_per_block: 64\n")
    kw = llm_kwargs(p.parse_args(["m", "--kv-cache-dtype", "fp8_e4m3", "-q", "fp8",
                                  "--kv_cache_free_gpu_memory_fraction", "0.5", "--speculative-config",
                                  '{"method": "ngram", "num_speculative_tokens": 3}',
                                  "--config", str(tmp_path / "kv.yaml")]))
    assert kw["kv_cache_config"] == {"dtype": "fp8", "free_gpu_memory_fraction": 0.5, "tokens_per_block": 64}
    assert kw["quantization"] == "fp8"
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    from phalanx.config import make_llm_args
    assert make_llm_args(**kw).speculative_config.decoding_type == "NGram"
    # a YAML's speculative_config replaces the flag's whole (one proposer, one spelling)
    (tmp_path / "spec.yaml").write_text("speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n")
    kw = llm_kwargs(p.parse_args(["m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                                  "--config", str(tmp_path / "spec.yaml")]))
    assert kw["speculative_config"] == {"decoding_type": "NGram", "max_draft_len": 2}
    for bad in (["--speculative-config", "{nope"], ["--speculative-config", "[1]"], ["--kv-cache-dtype", "int8"]):
        with pytest.raises(SystemExit):
            p.parse_args(["m", *bad])
    import socket
    with socket.socket() as s:      # a free port (the engine is started after the port is claimed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([phalanx_bin(), "serve", "--config", str(tmp_path / "c.yaml"), "--port", str(port)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "/nowhere/model" in res.stderr and "multiple values" not in res.stderr, res.stderr
    res = subprocess.run([phalanx_bin(), "serve", "--chat_template", "{% if x %}", "--port", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "--chat_template: not a valid Jinja template" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_vllms_kv_offloading_flags_give_each_rank_its_share_of_the_host_tier(tmp_path):
    """--kv-offloading-size is GiB summed over the ranks (vLLM's): each rank's host tier in
    bytes, shared out over the ranks the YAML leaves; the backend is native only and needs the
    size; the YAML's setting wins over the flag's."""
    import argparse

    from phalanx.config import make_llm_args
    from phalanx.serve.cli import add_serve_args, llm_kwargs
    p = argparse.ArgumentParser()
    add_serve_args(p)

    def per_rank(*argv: str) -> int:
        return make_llm_args(**llm_kwargs(p.parse_args(["m", *argv]))).host_cache_bytes
    assert per_rank("--kv-offloading-size", "8", "--kv-offloading-backend", "native") == 8 << 30
    assert per_rank("--kv_offloading_size", "1.5", "--tp_size", "2") == 3 << 28
    (tmp_path / "tp.yaml").write_text("tensor_parallel_size: 2\n")
    assert per_rank("--kv-offloading-size", "16", "--config", str(tmp_path / "tp.yaml")) == 8 << 30
    (tmp_path / "off.yaml").write_text("kv_offloading_size: 4\n")
    assert per_rank("--kv-offloading-size", "16", "--config", str(tmp_path / "off.yaml")) == 4 << 30
    for bad, what in ((["--kv-offloading-backend", "native"], "kv_offloading_backend"),
                      (["--kv-offloading-size", "0"], "kv_offloading_size")):
        with pytest.raises(ValueError, match=what):
            per_rank(*bad)
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--kv-offloading-backend", "lmcache", "--kv-offloading-size", "1"])
