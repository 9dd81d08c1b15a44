"""The user side's request state (executor/result.py) as the dispatcher drives it: a step's
``TokenBatch`` applied row by row equals its Responses applied one by one, waiters of every kind
are woken, and a whole batch wakes an event loop once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from phalanx.executor.executor import GenerationExecutor
from phalanx.executor.messages import Finished, FirstToken, TokenBatch, pack, unpack
from phalanx.executor.result import GenerationResult
from phalanx.llmapi.outputs import RequestOutput
from phalanx.llmapi.sampling_params import SamplingParams


class _Loopback(GenerationExecutor):
    """An executor whose transport keeps what it was asked to send (the dispatch side is real)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[object] = []

    def _send_request(self, msg) -> None:
        self.sent.append(msg)

    def _send_cancel(self, request_id: int) -> None:
        self.sent.append(("cancel", request_id))

    def _send_control(self, ctl) -> None:
        self.sent.append(ctl)

    def shutdown(self) -> None:
        pass


def _batch(ids: list[int], step: int, finished: tuple[int, ...] = (), first: tuple[int, ...] = (),
           logprobs: bool = False) -> TokenBatch:
    """A step's TokenBatch as rank 0 sends it (through the wire form)."""
    lps = [[-0.5 - rid / 100, 2, [[7, -0.25], [rid, -0.5 - rid / 100]]] for rid in ids] if logprobs else None
    return unpack(pack(TokenBatch(
        list(ids), [_tokens(rid, step, logprobs) for rid in ids], lps,
        [Finished(rid, "length", None) for rid in finished],
        [FirstToken(rid, 32, 64, 12.5, 1) for rid in first], "v1")))


def _tokens(rid: int, step: int, logprobs: bool = False) -> list[int] | int:
    """A row's tokens: every third request gets two a step (a verify step's), unless logprobs are on."""
    return [100 + step, 200 + step] if rid % 3 == 0 and not logprobs else 100 + step


def _expected(rid: int, steps: int, logprobs: bool = False) -> list[int]:
    out: list[int] = []
    for step in range(steps):
        t = _tokens(rid, step, logprobs)
        out += t if isinstance(t, list) else [t]
    return out


def _submit_all(ex: GenerationExecutor, n: int, params: SamplingParams) -> list[RequestOutput]:
    return [RequestOutput(ex.submit([1, 2, 3], params, None)) for _ in range(n)]


@pytest.mark.parametrize("logprobs", [False, True])
def test_token_batch_rows_apply_as_their_responses(logprobs):
    params = SamplingParams(max_tokens=3, logprobs=2 if logprobs else None, detokenize=False)
    by_row, by_response = _Loopback(), _Loopback()
    outs_row = _submit_all(by_row, 6, params)
    outs_resp = _submit_all(by_response, 6, params)
    ids = [o.request_id for o in outs_row]
    assert ids == [o.request_id for o in outs_resp]
    steps = [_batch(ids, 0, first=tuple(ids), logprobs=logprobs),
             _batch(ids, 1, finished=(ids[0], ids[3]), logprobs=logprobs),
             _batch(ids[1:3] + ids[4:], 2, finished=tuple(ids[1:3] + ids[4:]), logprobs=logprobs)]
    for batch in steps:
        by_row._dispatch_other(batch)
        by_response._dispatch(batch.responses())
    for a, b in zip(outs_row, outs_resp, strict=True):
        a._pull()
        b._pull()
        assert a.finished and b.finished
        sa, sb = a._state.snapshot(), b._state.snapshot()
        assert sa._replace(metrics={}) == sb._replace(metrics={})
        assert a._state.rank == b._state.rank == 1 and a.cached_tokens == 32
        assert a._state.first_scheduled_time == 12.5
        assert a.metrics["ttft"] >= 0 and a.metrics["e2e"] >= a.metrics["ttft"] and a.metrics["rank"] == 1
        a.metrics["e2e"] = -1.0                          # the caller's copy: the state's is unchanged
        assert a._state.metrics()["e2e"] >= 0
        rid = a.request_id
        assert a.outputs[0].token_ids == _expected(rid, 2 if rid in (ids[0], ids[3]) else 3, logprobs)
        assert a.outputs[0].weight_versions == [(0, "v1")]
        if logprobs:
            assert len(a.outputs[0].logprobs) == len(steps) - (rid in (ids[0], ids[3]))
    assert by_row.num_pending == by_response.num_pending == 0


def test_a_batch_wakes_each_event_loop_once():
    ex = _Loopback()
    params = SamplingParams(max_tokens=2, detokenize=False)
    outs = _submit_all(ex, 64, params)
    ids = [o.request_id for o in outs]

    async def main() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counted(cb, *args):
            calls.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counted   # type: ignore[method-assign]

        async def stream(o: RequestOutput) -> list[int]:
            seen = []
            async for out in o:
                seen += out.outputs[0].token_ids_diff
            return seen

        tasks = [asyncio.create_task(stream(o)) for o in outs]
        await asyncio.sleep(0)   # every stream waits for its first change
        sender = threading.Thread(target=lambda: (ex._dispatch_other(_batch(ids, 0, first=tuple(ids))),
                                                  ex._dispatch_other(_batch(ids, 1, finished=tuple(ids)))))
        sender.start()
        got = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        sender.join()
        assert 1 <= len(calls) <= 2, f"{len(calls)} wake-ups for 2 batches of 64 requests"
        return got

    got = asyncio.run(main())
    for rid, seen in zip(ids, got, strict=True):
        assert seen == _expected(rid, 2)


def test_a_closed_event_loop_does_not_stop_the_others_being_woken():
    ex = _Loopback()
    params = SamplingParams(max_tokens=1, detokenize=False)
    dead, live = _submit_all(ex, 2, params)
    closed = asyncio.new_event_loop()
    dead._state._waiters.append((closed, closed.create_future()))
    closed.close()

    async def main() -> bool:
        threading.Thread(target=ex._dispatch_other,
                         args=(_batch([dead.request_id, live.request_id], 0,
                                      finished=(dead.request_id, live.request_id)),)).start()
        out = await asyncio.wait_for(live.aresult(), 10)
        return out.finished

    assert asyncio.run(main())
    assert dead.done and live.done


def test_blocking_waiters_are_woken_by_a_row():
    ex = _Loopback()
    (out,) = _submit_all(ex, 1, SamplingParams(max_tokens=2, detokenize=False))
    got: list[list[int]] = []
    reader = threading.Thread(target=lambda: got.extend(o.outputs[0].token_ids_diff for o in out))
    reader.start()
    ex._dispatch_other(_batch([out.request_id], 0, first=(out.request_id,)))
    ex._dispatch_other(_batch([out.request_id], 1, finished=(out.request_id,)))
    reader.join(10)
    assert not reader.is_alive()
    assert sum(got, []) == out.outputs[0].token_ids and out.finished
    assert out.result(timeout=1).outputs[0].finish_reason == "length"


def test_a_failing_row_fails_its_request_alone(monkeypatch):
    ex = _Loopback()
    a, b = _submit_all(ex, 2, SamplingParams(max_tokens=1, detokenize=False))
    real = GenerationResult.handle_row

    def broken(self, request_id, *args):
        if request_id == a.request_id:
            raise KeyError("a bug in output handling")
        return real(self, request_id, *args)

    monkeypatch.setattr(GenerationResult, "handle_row", broken)
    ex._dispatch_other(_batch([a.request_id, b.request_id], 0, finished=(a.request_id, b.request_id)))
    assert b.result(timeout=1).outputs[0].token_ids == _expected(b.request_id, 1)
    with pytest.raises(Exception, match="output handling failed"):
        a.result(timeout=1)
    assert ex.num_pending == 0


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_stream_pulls_only_what_is_new_into_lists_that_grow_in_place(logprobs):
    ex = _Loopback()
    params = SamplingParams(max_tokens=40, logprobs=2 if logprobs else None, detokenize=False)
    [out] = _submit_all(ex, 1, params)
    state, rid = out._state, out.request_id
    seen_lists, steps = None, 40
    for step in range(steps):
        ex._dispatch_other(_batch([rid], step, finished=(rid,) if step == steps - 1 else (),
                                  first=(rid,) if step == 0 else (), logprobs=logprobs))
        before = out._seen[0]
        snap = state.snapshot(out._seen, out._seen_logprobs)
        assert snap.seqs[0].new_token_ids == _expected(rid, step + 1, logprobs)[before:]   # the new ones only
        out._pull()
        o = out.outputs[0]
        assert o.token_ids == _expected(rid, step + 1, logprobs)
        assert o.token_ids_diff == _expected(rid, step + 1, logprobs)[before:]
        if seen_lists is None:
            seen_lists = (o.token_ids, o.logprobs)
        assert o.token_ids is seen_lists[0] and o.logprobs is seen_lists[1]      # extended, not rebuilt
        if logprobs:
            assert len(o.logprobs) == step + 1 and len(o.logprobs_diff) == 1
            assert o.logprobs_diff[0] is o.logprobs[-1]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert state.snapshot().seqs[0].new_token_ids == out.outputs[0].token_ids   # no count: everything


def test_the_servers_metrics_count_every_token_and_time_each_sequence_apart():
    """Two sequences (n = 2), chunks of several tokens (a verify step's accepted drafts): the
    generation counter takes every token, and inter-token latency is observed between one
    sequence's chunks only (never between two sequences' tokens of one step)."""
    pytest.importorskip("prometheus_client")
    from phalanx.serve.metrics import ServerMetrics
    res = GenerationResult(7, [70, 71], None, [1, 2, 3], SamplingParams(max_tokens=8, n=2), None, lambda rid: None)
    for step in range(3):
        for rid in (70, 71):
            res.handle_row(rid, [5, 6] if rid == 70 else [9], None,
                           Finished(rid, "length", None) if step == 2 else None, None, "")
    assert [len(t) for t in res.token_times] == [3, 3]
    from types import SimpleNamespace

    from phalanx.serve.openai_server import OpenAIServer
    metrics = ServerMetrics("m", lambda: [])
    done = RequestOutput(res, streaming=False).result(timeout=5)
    assert [len(o.token_ids) for o in done.outputs] == [6, 3]
    OpenAIServer._observe(SimpleNamespace(metrics=metrics), done)   # type: ignore[arg-type]
    text = metrics.render().decode()
    assert 'phalanx:generation_tokens_total{model_name="m"} 9.0' in text
    assert 'phalanx:inter_token_latency_seconds_count{model_name="m"} 4.0' in text   # 2 a sequence, not 5


def test_a_step_of_several_tokens_keeps_a_logprob_for_each_under_stop_strings():
    """A step that brings several tokens (a verify step's) to a sequence with stop strings is
    applied token by token; each keeps its logprob, so logprobs and tokens stay as many."""
    from phalanx.executor.result import _Sequence
    from phalanx.llmapi.tokenizer import Tokenizer, _gguf_tokenizer
    from phalanx.models.source import bundled_model_path
    tok = Tokenizer(_gguf_tokenizer(bundled_model_path()))
    seq = _Sequence(0, SamplingParams(max_tokens=8, stop=["zzz"], logprobs=1), tok, [1, 2, 3])
    ids = tok.encode(" Paris is", add_special_tokens=False)
    seq.add(ids, [[-0.5, 1, [[t, -0.5]]] for t in ids], None, None, "v1")
    seq.add(ids[:1], [[-0.25, 1, [[ids[0], -0.25]]]], None, None, "v1")
    assert len(ids) > 1 and seq.token_ids == ids + ids[:1]
    assert seq.logprobs is not None and [e[t].logprob for t, e in zip(seq.token_ids, seq.logprobs, strict=True)] \
        == [-0.5] * len(ids) + [-0.25]
