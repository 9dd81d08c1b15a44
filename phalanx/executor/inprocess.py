"""InProcessExecutor: the rank loop in a thread of the caller's process (one rank, no MPI)."""

from __future__ import annotations

import threading
import traceback

from phalanx.config import LlmArgs
from phalanx.executor.executor import GenerationExecutor
from phalanx.executor.messages import GenerationRequest
from phalanx.models.source import ModelSource
from phalanx.pyexecutor.creator import create_py_executor
from phalanx.pyexecutor.py_executor import PyExecutor, RequestQueue


class InProcessExecutor(GenerationExecutor):
    def __init__(self, args: LlmArgs, source: ModelSource) -> None:
        super().__init__()
        self.queue = RequestQueue()
        self.engine: PyExecutor | None
        self.engine, self.info = create_py_executor(args, source, self, self.queue)
        self._thread = threading.Thread(target=self._run, name="phalanx-executor", daemon=True)
        self._thread.start()
        self._start_watchdog(args.engine_iteration_timeout)

    def _run(self) -> None:
        assert self.engine is not None
        try:
            self.engine.run()
        except BaseException:
            self._fail_all(f"the executor loop died:\n{traceback.format_exc()}")
            return
        self._fail_all("the engine has been shut down")

    def _send_request(self, msg: GenerationRequest) -> None:
        self.queue.put_request(msg)

    def _send_cancel(self, request_id: int) -> None:
        self.queue.put_cancel(request_id)

    def _send_control(self, ctl) -> None:
        self.queue.put_control(ctl)

    # Sender protocol: the engine thread hands results straight to the dispatcher.
    def send_responses(self, responses) -> None:
        self._dispatch(responses)

    def send(self, obj) -> None:
        self._dispatch_other(obj)

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self.queue.put_shutdown()
            self._thread.join(timeout)
        if not self._thread.is_alive() and self.engine is not None:
            device = self.engine.runner.device
            self.engine = None                       # the model, KV pool and graphs go with it
            import gc
            gc.collect()
            if device.type == "cuda":
                import torch
                torch.cuda.empty_cache()
