"""`mpirun -n 2 phalanx launch -- python script.py`: the script's LLM attaches to the job.
Also: interpreter exit (or a killed user process, even one whose job hangs in start-up) leaves
no process behind."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hf_reference import hf_greedy
from phalanx.executor.proxy import find_mpirun
from rank_faults import fault_in_rank_build

pytestmark = pytest.mark.mpi

SCRIPT = """
import sys
from phalanx import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, skip_tokenizer_init=True)
out = llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
print("TOKENS", out.outputs[0].token_ids, flush=True)
llm.shutdown()
"""


def test_launch_runs_a_script_whose_llm_uses_the_job(tmp_path, tiny_models, hf_models):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    cmd = [find_mpirun(), "-n", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    phalanx = os.path.join(os.path.dirname(sys.executable), "phalanx")
    cmd += [phalanx, "launch", "--", sys.executable, str(script), tiny_models["llama"]]
    env = dict(os.environ, OMPI_MCA_btl="^tcp")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("TOKENS"))
    tokens = eval(line[len("TOKENS"):])
    ref, _ = hf_greedy(hf_models["llama"], [5, 6, 7, 8], 8)
    assert tokens == ref


EXIT_SCRIPT = """
import sys, os
from phalanx import LLM, SamplingParams
llm = LLM(sys.argv[1], skip_tokenizer_init=True)
print("JOB", llm._executor.proc.pid, flush=True)
llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
if sys.argv[2] == "kill":
    print("READY", flush=True)
    import time; time.sleep(600)
# exit without shutdown()
"""


def _wait_gone(pids, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _job_pids(job_pid):
    root = psutil.Process(job_pid)
    return [job_pid] + [c.pid for c in root.children(recursive=True)]


def _run_exit_script(tmp_path, model: str, mode: str) -> tuple[subprocess.Popen, int]:
    """Start EXIT_SCRIPT in ``mode``; returns the process and its MPI job's pid."""
    script = tmp_path / f"{mode}.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), model, mode], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline().split()[1])


def test_interpreter_exit_without_shutdown_leaves_nothing(tmp_path, tiny_models):
    proc, job = _run_exit_script(tmp_path, tiny_models["qwen2"], "exit")
    pids = _job_pids(job)
    assert proc.wait(timeout=120) == 0
    assert _wait_gone(pids, 15) == []


def test_killed_user_process_takes_the_job_down(tmp_path, tiny_models):
    proc, job = _run_exit_script(tmp_path, tiny_models["qwen2"], "kill")
    assert proc.stdout.readline().startswith("READY")
    pids = _job_pids(job)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_gone(pids, 20) == []


def test_killed_user_process_takes_down_a_job_hung_in_start_up(tmp_path, tiny_models):
    """Rank 1 hangs while it builds the model, so rank 0 waits in a start-up exchange that never
    completes and never reads the user's socket: when the user process is killed, rank 0 still
    takes the job down (after its grace period)."""
    from phalanx.pyexecutor.worker import USER_GONE_GRACE_S
    hung = tmp_path / "hung"
    env = dict(os.environ, PYTHONPATH=fault_in_rank_build(
        tmp_path / "site", 1, f"open({str(hung)!r}, 'w').close()\nimport time\ntime.sleep(3600)"))
    code = "import sys; from phalanx import LLM; LLM(sys.argv[1], tensor_parallel_size=2, skip_tokenizer_init=True)"
    proc = subprocess.Popen([sys.executable, "-c", code, tiny_models["llama"]], env=env)
    pids = []
    try:
        deadline = time.time() + 180
        while not hung.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert hung.exists() and proc.poll() is None
        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(pids) >= 3      # mpirun and two ranks
    finally:
        proc.kill()
        proc.wait()
    left = _wait_gone(pids, USER_GONE_GRACE_S + 30)
    for pid in left:                     # a failure here must not leave the hung job spinning
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    assert left == []
