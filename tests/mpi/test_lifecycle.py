"""One MPI job per LLM, reaped on shutdown; the key never shows; bad frames are dropped;
streaming and abort at scale; rank failures fail every pending request, naming the rank."""

import asyncio
import json
import os
import signal
import time

import psutil
import pytest

from phalanx import LLM, SamplingParams
from phalanx.executor.executor import EngineDeadError
from phalanx.llmapi.outputs import RequestError
from phalanx.pyexecutor.host_clock import GcPauses
from rank_faults import fault_in_rank_build
from serve_helpers import job_exposure

pytestmark = pytest.mark.mpi


def mpi_jobs(llm=None) -> list[psutil.Process]:
    """MPI jobs below this process (only ``llm``'s job when given)."""
    jobs = [c for c in psutil.Process().children() if c.name() in ("mpirun", "prterun", "orterun")
            or "mpirun" in " ".join(c.cmdline()[:1])]
    if llm is not None:
        jobs = [j for j in jobs if j.pid == llm._executor.proc.pid]
    return jobs


def job_processes(llm) -> list[psutil.Process]:
    root = psutil.Process(llm._executor.proc.pid)
    return [root] + root.children(recursive=True)


@pytest.fixture(scope="module")
def tp2(tiny_models):
    with LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True,
             kv_cache_config={"tokens_per_block": 8}) as llm:
        yield llm


def greedy(n=8):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_one_job_while_alive_none_after_shutdown(tiny_models):
    before = {j.pid for j in mpi_jobs()}
    llm = LLM(tiny_models["qwen2"], skip_tokenizer_init=True)
    jobs = [j for j in mpi_jobs() if j.pid not in before]
    assert len(jobs) == 1 and jobs[0].pid == llm._executor.proc.pid
    pids = [p.pid for p in job_processes(llm)]
    assert len(pids) >= 2                        # mpirun and at least one rank
    assert llm.generate([1, 2, 3], greedy(), use_tqdm=False).outputs[0].length == 8
    llm.shutdown()
    assert {j.pid for j in mpi_jobs()} == before
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_key_in_no_argv_and_no_log(tp2):
    key = None
    # the key is in rank 0's environment only until read; look for it everywhere we can see
    for proc in job_processes(tp2):
        cmd = " ".join(proc.cmdline())
        assert "PHALANX_IPC_KEY" not in cmd
        try:
            env = proc.environ()
        except psutil.AccessDenied:
            continue
        key = key or env.get("PHALANX_IPC_KEY")
        assert "phalanx" not in cmd or "worker" in cmd or "mpirun" in cmd or "prterun" in cmd or "prted" in cmd
    key = key or tp2._executor.requests._key.hex()
    for proc in job_processes(tp2):
        assert key not in " ".join(proc.cmdline())
    assert key not in "\n".join(tp2._executor._stderr_tail)


def test_internal_sockets_listen_on_loopback_or_ipc_only(tp2):
    """The user process listens on loopback or ipc:// only; the job (Open MPI's launcher, which
    binds every interface, and the ranks) runs in a network namespace of its own."""
    for c in psutil.Process().net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN:
            assert c.laddr.ip in ("127.0.0.1", "::1"), c
    assert tp2._executor.requests.address.startswith("ipc://")
    isolated, exposed = job_exposure(tp2._executor.proc.pid)
    assert not exposed, exposed
    if not isolated:
        pytest.skip("no network namespace can be created here: the launcher runs in the host's")


def test_a_sigkilled_launcher_takes_its_ranks_and_leaves_no_files(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True)
    ranks = [p for p in job_processes(llm)[1:] if "python" in p.cmdline()[0]]
    private = llm._executor._dir
    assert len(ranks) == 2 and os.listdir(os.path.join(private, "mpi"))   # Open MPI's session files
    os.kill(llm._executor.proc.pid, signal.SIGKILL)
    deadline = time.time() + 5
    while time.time() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks):
        time.sleep(0.1)
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    deadline = time.time() + 5
    while time.time() < deadline and llm.is_alive:
        time.sleep(0.1)
    assert "exited" in llm.dead_error
    with pytest.raises(EngineDeadError):
        llm.generate_async([1, 2, 3], greedy())
    llm.shutdown()
    assert not os.path.exists(private)


def test_bad_frames_are_dropped_and_serving_continues(tp2):
    before = tp2.generate([5, 6, 7], greedy(), use_tqdm=False).outputs[0].token_ids
    ex = tp2._executor
    with ex._send_lock:
        ex.requests.socket.send(b"no tag here")
        ex.requests.socket.send(b"\x81\xa1t\xa6cancel" + b"\x00" * 32)
    after = tp2.generate([5, 6, 7], greedy(), use_tqdm=False).outputs[0].token_ids
    assert after == before
    deadline = time.time() + 5
    while time.time() < deadline and sum("dropped an IPC frame" in x for x in ex._stderr_tail) < 2:
        time.sleep(0.1)
    assert sum("dropped an IPC frame" in x for x in ex._stderr_tail) == 2


def test_fifty_concurrent_streams_are_exact(tp2):
    lengths = [3 + (i * 7) % 20 for i in range(50)]
    reference = {n: tp2.generate([9, 9, n], greedy(n), use_tqdm=False).outputs[0].token_ids for n in set(lengths)}

    async def stream(i, n):
        deltas, finished = [], []
        async for out in tp2.generate_async([9, 9, n], greedy(n), streaming=True):
            deltas += out.outputs[0].token_ids_diff
            finished.append(out.finished)
        return i, deltas, finished

    async def main():
        return await asyncio.gather(*(stream(i, n) for i, n in enumerate(lengths)))

    for i, deltas, finished in asyncio.run(main()):
        n = lengths[i]
        assert len(deltas) == n and deltas == reference[n]
        assert finished[-1] and not any(finished[:-1])


def test_every_rank_serves_with_its_start_up_frozen_and_counts_its_gc_pauses(tp2):
    """A rank process only serves once started: what start-up made is out of every collection
    (gc.freeze), its full collections wait for the loop to idle (the oldest generation's
    threshold raised while the loop runs), and the timing op reports the collector's pauses
    over the timed steps."""
    tp2.control("timing:on")
    try:
        tp2.generate([[9, 9, 4 + i] for i in range(16)], greedy(8), use_tqdm=False)
        timing = [json.loads(r) for r in tp2.control("timing").per_rank]
    finally:
        tp2.control("timing:off")
    for rank in timing:
        assert rank["gc_frozen"] > 10_000, rank["gc_frozen"]     # torch and the model alone make far more
        assert rank["gc_thresholds"][2] == GcPauses.BUSY_FULL_AFTER, rank["gc_thresholds"]
        # steady serving frees what it makes, so a short run may trigger no collection at all
        # (the counting itself: tests/unit/test_host_clock.py); what is reported must add up
        gc = rank["gc"]
        assert len(gc["collections"]) == len(gc["ms"]) == 3, gc
        assert (sum(gc["collections"]) == 0) == (gc["max_ms"] == 0.0) and gc["max_ms"] <= sum(gc["ms"]) + 1e-9, gc


def test_abort_ten_of_a_hundred(tp2):
    prompts = [[1 + i % 50, 2, 3 + i % 7] for i in range(100)]
    expected = [o.outputs[0].token_ids for o in tp2.generate(prompts, greedy(24), use_tqdm=False)]
    futs = [tp2.generate_async(p, greedy(24)) for p in prompts]
    aborted = set(range(0, 100, 10))
    for i in aborted:
        futs[i].abort()
    for i, f in enumerate(futs):
        out = f.result(timeout=120)
        if i in aborted:
            assert out.outputs[0].finish_reason in ("abort", "length")
        else:
            assert out.outputs[0].token_ids == expected[i] and out.outputs[0].finish_reason == "length"
    time.sleep(0.3)
    assert tp2._executor.check_integrity() == ["ok", "ok"]
    stats = tp2._executor.stats()
    assert all(s["num_running"] == 0 and s["num_available_blocks"] == s["num_blocks"] for s in stats)


@pytest.mark.parametrize("rank", [1, 0])
def test_kill_a_rank_fails_every_pending_request_then_a_new_llm_starts(rank, tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True)
    futs = [llm.generate_async([1, 2, i + 3], SamplingParams(max_tokens=400, ignore_eos=True), streaming=True)
            for i in range(6)]
    next(iter(futs[0]))                                   # generation is under way
    victim = [p for p in job_processes(llm) if p.environ().get("OMPI_COMM_WORLD_RANK") == str(rank)]
    assert len(victim) == 1
    t0 = time.time()
    os.kill(victim[0].pid, signal.SIGKILL)
    for f in futs:
        with pytest.raises(RequestError, match=rf"rank {rank} \(pid {victim[0].pid}\) died from signal 9"):
            f.result(timeout=10)
    assert time.time() - t0 < 10
    with pytest.raises(EngineDeadError):
        llm.generate_async([1, 2, 3], greedy())
    job = llm._executor.proc.pid
    llm.shutdown()
    assert job not in {j.pid for j in mpi_jobs()}
    with LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True) as again:
        assert again.generate([1, 2, 3], greedy(), use_tqdm=False).outputs[0].length == 8


def test_forward_exception_on_rank1_fails_pending_naming_the_rank(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True)
    try:
        llm._executor.control("fail_next_forward:1")
        fut = llm.generate_async([4, 5, 6], greedy())
        with pytest.raises(RequestError, match="rank 1"):
            fut.result(timeout=15)
    finally:
        job = llm._executor.proc.pid
        llm.shutdown()
    assert job not in {j.pid for j in mpi_jobs()}


def test_a_stopped_rank_is_found_and_named(tiny_models):
    """SIGSTOP of rank 1: rank 0 hangs in a collective, its heartbeats stop, and after the
    iteration timeout every pending request fails naming rank 1; the job is taken down."""
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True, engine_iteration_timeout=3)
    try:
        fut = llm.generate_async([1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True), streaming=True)
        next(iter(fut))
        rank1 = [p for p in job_processes(llm) if p.environ().get("OMPI_COMM_WORLD_RANK") == "1"][0]
        t0 = time.time()
        rank1.suspend()
        with pytest.raises(RequestError, match=r"stalled: rank 1 \(pid \d+\) is stopped"):
            fut.result(timeout=30)
        assert 2 <= time.time() - t0 < 10    # measured from the last heartbeat, before the stop
        assert not llm.is_alive and "rank 1" in llm.dead_error
        deadline = time.time() + 10
        while time.time() < deadline and rank1.is_running() and rank1.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.1)
        assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE
    finally:
        llm.shutdown()


def test_rank_divergence_is_detected_and_named(tiny_models):
    llm = LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True)
    try:
        llm._executor.control("skew_scheduler:1")
        fut = llm.generate_async([4, 5, 6], greedy())
        with pytest.raises(RequestError, match=r"divergence.*rank\(s\) \[1\]"):
            fut.result(timeout=15)
    finally:
        llm.shutdown()


def test_startup_failure_reports_the_rank_traceback(tmp_path, tiny_models):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.truncate(100)
    from phalanx.executor.proxy import EngineStartError
    before = {j.pid for j in mpi_jobs()}
    t0 = time.time()
    with pytest.raises(EngineStartError, match=r"rank [01] failed to start"):   # both ranks fail
        LLM(str(bad), tensor_parallel_size=2, skip_tokenizer_init=True)
    assert time.time() - t0 < 60
    assert {j.pid for j in mpi_jobs()} <= before


def test_startup_failure_on_rank1_alone_reports_its_traceback(tmp_path, tiny_models, monkeypatch):
    """Rank 0 waits in a start-up exchange for rank 1, which failed before it: the job must not
    hang there. Rank 1 reports its traceback and takes the job down."""
    from phalanx.executor.proxy import EngineStartError
    monkeypatch.setenv("PYTHONPATH", fault_in_rank_build(
        tmp_path / "site", 1, 'raise MemoryError("rank 1 is out of memory")'))
    monkeypatch.setenv("PHALANX_STARTUP_TIMEOUT", "150")   # a hang fails the test, not the suite
    before = {j.pid for j in mpi_jobs()}
    t0 = time.time()
    with pytest.raises(EngineStartError) as err:
        LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True)
    assert time.time() - t0 < 120
    message = str(err.value)
    assert message.startswith("rank 1 failed to start: MemoryError: rank 1 is out of memory"), message
    assert "Traceback (most recent call last)" in message and "in build_model" in message
    assert {j.pid for j in mpi_jobs()} <= before


def test_a_setting_a_rank_refuses_is_reported_in_one_line(tmp_path, tiny_models, monkeypatch):
    """A ValueError at start-up is a setting refused by name: the report is its message (the
    traceback, which says nothing more to the user, is left out), while other failures keep
    theirs (above)."""
    from phalanx.executor.proxy import EngineStartError
    monkeypatch.setenv("PYTHONPATH", fault_in_rank_build(
        tmp_path / "site", 1, 'raise ValueError("kv_cache_config.max_tokens: must be at least 32, got 1")'))
    monkeypatch.setenv("PHALANX_STARTUP_TIMEOUT", "150")
    with pytest.raises(EngineStartError) as err:
        LLM(tiny_models["llama"], tensor_parallel_size=2, skip_tokenizer_init=True)
    message = str(err.value)
    assert message.startswith("rank 1 failed to start: ValueError: kv_cache_config.max_tokens: must be at least 32, "
                              "got 1"), message
    assert "Traceback" not in message, message


def test_a_tokenizer_that_fails_to_load_takes_the_started_job_down(tmp_path, tiny_models):
    """The tokenizer loads while the ranks start: its failure is raised as it would be alone,
    the wait for the ranks stops at it (the tokenizer fails in a second or two, the ranks take
    longer), and the job already started goes with it."""
    import traceback
    before = {j.pid for j in mpi_jobs()}
    with pytest.raises(Exception) as err:
        LLM(tiny_models["qwen2"], tokenizer=str(tmp_path / "no-such-tokenizer"))
    assert "no-such-tokenizer" in str(err.value)
    assert "_handshake" in [f.name for f in traceback.extract_tb(err.value.__traceback__)]
    assert {j.pid for j in mpi_jobs()} <= before
