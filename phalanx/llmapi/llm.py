"""LLM: the Python entry point (names as TensorRT-LLM's LLM API).

    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))
    fut = llm.generate_async("Hi", streaming=True)

Text work (tokenization, chat templates, detokenization, stop strings) happens here, in the
caller's process; the executor sees token ids.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from phalanx.config import LlmArgs, make_llm_args
from phalanx.executor.messages import ControlResult
from phalanx.llmapi.lora_request import LoRARequest
from phalanx.llmapi.lora_request import per_prompt as lora_per_prompt
from phalanx.llmapi.outputs import RequestOutput
from phalanx.llmapi.sampling_params import MAX_CACHE_SALT, SamplingParams, bad_word_sequences, check_prompt
from phalanx.llmapi.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from phalanx.llmapi.beam_search import BeamSearchOutput, BeamSearchParams
    from phalanx.llmapi.grammar import GrammarCompiler

logger = logging.getLogger("phalanx")

PromptInput = str | list[int] | dict[str, Any]


class PreparedPrompt(NamedTuple):
    """A prompt tokenized and checked, ready to submit."""

    prompt: str | None
    token_ids: list[int]
    params: SamplingParams


class LLM:
    def __init__(self, model: str | None = None, tokenizer: str | None = None, **kwargs: Any) -> None:
        t0 = time.monotonic()
        self.args: LlmArgs = make_llm_args(model=model, tokenizer=tokenizer, **kwargs)
        from phalanx.models.source import resolve_model
        self.source = resolve_model(self.args.model, self.args.trust_remote_code).with_draft(
            self.args.speculative_config, self.args.trust_remote_code)
        # the tokenizer loads (seconds: transformers' import, a GGUF vocabulary) while the ranks
        # start; one that fails to load stops the start (the ranks' wait checks it) or takes the
        # started engine down, and its own error is raised
        tokenizing = None if self.args.skip_tokenizer_init else _Background(
            "phalanx-tokenizer-load", load_tokenizer, self.source, self.args.tokenizer, self.args.trust_remote_code)
        self._executor = self._create_executor(None if tokenizing is None else tokenizing.raise_if_failed)
        try:
            self.tokenizer: Tokenizer | None = None if tokenizing is None else tokenizing.result()
            self.engine_info = self._executor.info
            self.max_seq_len: int = self._executor.info.max_seq_len
            self.vocab_size: int = self._executor.info.vocab_size
            self.startup_seconds = time.monotonic() - t0
        except BaseException:
            with contextlib.suppress(Exception):
                self._executor.shutdown()
            raise
        self._grammars: GrammarCompiler | None = None
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}   # bad_word_ids', by the words
        self._closed = False
        _live.add(self)

    def _create_executor(self, startup_check: Callable[[], None] | None = None):
        """The executor, started. ``startup_check``: called while the ranks start; what it raises
        stops the start."""
        if self.args.orchestrator_type == "inprocess":
            if self.args.world_size > 1:
                raise ValueError("orchestrator_type='inprocess' runs one rank: tensor_parallel_size must be 1")
            from phalanx.executor.inprocess import InProcessExecutor
            return InProcessExecutor(self.args, self.source)
        from phalanx.executor.proxy import MpiProxyExecutor
        args = self.args
        if self.source.kind == "hf" and args.model != self.source.path:   # a hub id: ranks read the download
            args = args.model_copy(update={"model": self.source.path})
        return MpiProxyExecutor(args, model_source=self.source.to_wire(), startup_check=startup_check)

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, inputs: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a batch; returns one RequestOutput per prompt (a single
        one for a single prompt). ``sampling_params`` is one for all or a list with one per prompt;
        ``lora_request`` (an engine with ``lora_config``) likewise.

        Every prompt is tokenized and checked before any is submitted; if one fails later (or
        the caller is interrupted), the others are aborted."""
        if not isinstance(inputs, Iterable):
            raise ValueError(f"inputs must be a prompt (a string, token ids or a dict) or a list of prompts, "
                             f"got {type(inputs).__name__}")
        single = _is_single(inputs)
        prompts: list[Any] = [inputs] if single else list(inputs)  # type: ignore[arg-type, unused-ignore]
        params = _per_prompt(sampling_params, len(prompts))
        loras = self._loras(lora_request, len(prompts))
        prepared = [self._prepare(p, sp) for p, sp in zip(prompts, params, strict=True)]
        futures = self._submit_all(prepared, cache_salt, loras=loras)
        try:
            outs = [f.result() for f in _progress(futures, use_tqdm and len(futures) > 1)]
        except BaseException:
            for f in futures:
                f.abort()
            raise
        return outs[0] if single else outs

    def generate_async(self, inputs: PromptInput, sampling_params: SamplingParams | None = None,
                       streaming: bool = False, cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None) -> RequestOutput:
        """Submit one prompt; returns a RequestOutput future (``.result()``, ``await .aresult()``;
        ``async for`` / ``for`` yields each update when streaming, else once, the finished output;
        cancelling the task that consumes the stream aborts the request)."""
        # (the first item tells: a prompt's ids are ints, which _prepare checks every one of)
        if isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], (str, dict, list, tuple)):
            raise ValueError("inputs: generate_async takes one prompt (a string, token ids or a dict); "
                             "got a list of prompts: use generate for a batch")
        loras = self._loras(lora_request, 1)
        return self._submit_all([self._prepare(inputs, sampling_params)], cache_salt, streaming, loras)[0]

    def beam_search(self, prompts: Sequence[PromptInput], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's ``LLM.beam_search``, ``llmapi/beam_search.py``): a
        ``BeamSearchOutput`` a prompt, its ``params.beam_width`` best beams first."""
        from phalanx.llmapi.beam_search import beam_search
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence) or _is_single(prompts):
            raise ValueError("prompts: beam_search takes a list of prompts (strings, token ids or dicts)")
        return beam_search(self, list(prompts), params, self._loras(lora_request, len(prompts)), use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             cache_salt: str | None = None, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for one conversation (a list of messages) or several (a list of them), each
        rendered by the chat template: a list of RequestOutputs, one a conversation (as vLLM's
        ``LLM.chat``). A message's content is a string or OpenAI's text parts. With
        ``continue_final_message`` (and ``add_generation_prompt=False``) the prompt ends inside
        the final message, which the model goes on writing. ``tools`` (OpenAI's function
        definitions) go to the template as its ``tools``, as vLLM's; reading calls back from
        the output is the server's (``phalanx serve``)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True)")
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a list of messages or a list of conversations, "
                             f"got {type(messages).__name__}")
        reserved = sorted(set(chat_template_kwargs or {}) & {"add_generation_prompt", "chat_template", "tokenize",
                                                             "max_tokens", "messages", "continue_final_message"})
        if reserved:
            raise ValueError(f"chat_template_kwargs: {reserved[0]} is an argument of chat itself")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true while add_generation_prompt is true (the "
                             "default): pass add_generation_prompt=False to continue the final message")
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [_chat_messages(messages)] if single else [_chat_messages(c) for c in messages]
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            if not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
                raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
            if "tools" in kwargs:
                raise ValueError("tools: given twice (as an argument and in chat_template_kwargs)")
            kwargs["tools"] = list(tools)
        if continue_final_message:
            kwargs["continue_final_message"] = True
        each = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params]
        truncated = any(sp is not None and getattr(sp, "truncate_prompt_tokens", None) for sp in each)
        limit = None if truncated else self.max_seq_len - 1     # (a long chat to be truncated is rendered whole)
        prompts = [dict(zip(("prompt", "prompt_token_ids"), self.tokenizer.render_chat(
            c, add_generation_prompt, chat_template, limit, **kwargs), strict=True)) for c in convs]
        if not prompts:
            return []
        outs = self.generate(prompts, sampling_params, use_tqdm, cache_salt, lora_request)
        return outs if isinstance(outs, list) else [outs]

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (vLLM's ``get_tokenizer``); ``llm.tokenizer`` is phalanx's own."""
        if self.tokenizer is None:
            raise ValueError("get_tokenizer: this LLM has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer.hf

    def _prepare(self, inputs: PromptInput, sampling_params: SamplingParams | None) -> PreparedPrompt:
        """Tokenize and check one prompt and its params (raises ValueError naming the field)."""
        self._check_open()
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}"
                             + (" (SamplingParams(**d) takes a dict's fields)" if isinstance(sampling_params, dict)
                                else ""))
        # the request keeps a copy of its own: the caller may change and reuse the object while it runs
        params = SamplingParams() if sampling_params is None else copy.copy(sampling_params)
        params.validate()   # the fields may have been changed since it was built
        self.check_grammar(params)
        if params.bad_words:
            params.add_bad_word_ids(self.bad_word_ids(tuple(params.bad_words)))
        keep = self.kept_prompt_tokens(params.truncate_prompt_tokens)
        prompt, ids = self._tokenize(inputs, keep is None)
        if keep is not None and len(ids) > keep:
            check_prompt(ids, self.vocab_size, len(ids) + 1)   # every id, before the cut drops some
            ids = ids[-keep:]
            prompt = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else None
        self._check_prompt(ids, params)
        return PreparedPrompt(prompt, ids, params)

    def bad_word_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """``bad_words``' token sequences (``sampling_params.bad_word_sequences``), tokenized once
        for each set of words (a batch's prompts share theirs)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (skip_tokenizer_init=True): pass bad_words_token_ids")
        seqs = self._bad_words.get(words)
        if seqs is None:
            tokenizer = self.tokenizer
            seqs = bad_word_sequences(words, lambda text: tokenizer.encode(text, add_special_tokens=False))
            if len(self._bad_words) >= 256:
                self._bad_words.clear()
            self._bad_words[words] = seqs
        return seqs

    def kept_prompt_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        """The most prompt tokens ``truncate_prompt_tokens`` keeps (the last ones; -1: max_seq_len),
        None where prompts are not truncated. More than max_seq_len is refused, as vLLM does."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens > self.max_seq_len:
            raise ValueError(f"truncate_prompt_tokens {truncate_prompt_tokens} is more than max_seq_len "
                             f"{self.max_seq_len}")
        return self.max_seq_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def _loras(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
               n: int) -> list[LoRARequest | None] | None:
        """The adapter of each of ``n`` prompts (None: none asked)."""
        if lora_request is None:
            return None
        if self.args.lora is None:
            raise ValueError("lora_request: this LLM serves no LoRA adapters (start it with lora_config or "
                             "enable_lora=True)")
        return lora_per_prompt(lora_request, n)

    def _submit_all(self, prepared: list[PreparedPrompt], cache_salt: str | None,
                    streaming: bool = False, loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Submit checked prompts; if one submit fails, the ones already sent are aborted."""
        if cache_salt is not None and not (isinstance(cache_salt, str) and len(cache_salt) <= MAX_CACHE_SALT):
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters, got "
                             + (f"{len(cache_salt)}" if isinstance(cache_salt, str) else type(cache_salt).__name__))
        futures: list[RequestOutput] = []
        try:
            for i, p in enumerate(prepared):
                eos = (p.params.end_id,) if p.params.end_id is not None else self._eos_token_ids()
                lora = loras[i] if loras is not None else None
                state = self._executor.submit(p.token_ids, p.params, self.tokenizer, p.prompt, eos, cache_salt,
                                              lora=lora.to_wire() if lora is not None else None)
                futures.append(RequestOutput(state, streaming))
        except BaseException:
            for f in futures:
                f.abort()
            raise
        return futures

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile ``params.guided_decoding`` here (cached), so that one that does not compile is
        refused with a ValueError naming the field before it is submitted. Without a tokenizer
        the ranks check it instead (the request then fails with their message)."""
        if params.guided_decoding is None or self.tokenizer is None:
            return
        if self._grammars is None:
            from phalanx.llmapi.grammar import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer.hf, self.vocab_size, self._eos_token_ids())
        self._grammars.compile(params.guided_decoding)

    def _eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_ids
        return tuple(self.source.config.eos_token_ids)

    def _tokenize(self, inputs: PromptInput, bounded: bool = True) -> tuple[str | None, list[int]]:
        """A prompt's text (if it has one) and token ids; a text too long for max_seq_len is
        refused before it is tokenized unless not ``bounded`` (it is to be truncated)."""
        if isinstance(inputs, dict):
            unknown = sorted(map(str, set(inputs) - {"prompt", "prompt_token_ids"}))
            if unknown:
                raise ValueError(f"{unknown[0]}: not supported (a prompt dict takes 'prompt' and 'prompt_token_ids'; "
                                 f"got {unknown})")
            if "prompt_token_ids" in inputs:
                ids = inputs["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
                return inputs.get("prompt"), list(ids)
            inputs = inputs.get("prompt", "")
        if isinstance(inputs, str):
            if not inputs:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer (skip_tokenizer_init=True): pass token ids")
            return inputs, self.tokenizer.encode(inputs, max_tokens=self.max_seq_len - 1 if bounded else None)
        if isinstance(inputs, (list, tuple)):   # token ids: check_prompt checks each
            return None, list(inputs)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(inputs).__name__}")

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        check_prompt(ids, self.vocab_size, self.max_seq_len)
        params.check_vocab(self.vocab_size)
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"max_tokens {params.max_tokens} and a prompt of {len(ids)} tokens exceed max_seq_len "
                             f"{self.max_seq_len} (at most {self.max_seq_len - len(ids)} new tokens fit; "
                             f"max_tokens=None generates up to the limit)")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop needs a tokenizer: stop strings are matched in the output's text, and this LLM "
                             "has none (skip_tokenizer_init=True); stop_token_ids need no text")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> Any:
        """The chat as the template renders it (``tokenize=True``: as token ids, control tokens
        from the template only, as ``chat`` sends it)."""
        if self.tokenizer is None:
            raise ValueError("apply_chat_template needs a tokenizer (skip_tokenizer_init=True)")
        if tokenize:
            return self.tokenizer.encode_chat(messages, add_generation_prompt, **kwargs)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)

    # -- the engine, for servers, benchmarks and operators ---------------------------------------------
    @property
    def is_alive(self) -> bool:
        """True while the engine can serve (not shut down, no rank dead or stalled)."""
        return not self._closed and self._executor.dead_error is None

    @property
    def dead_error(self) -> str | None:
        """Why the engine stopped serving (None while it is alive)."""
        return "this LLM has been shut down" if self._closed else self._executor.dead_error

    def stats(self) -> list[dict[str, Any]]:
        """Every rank's engine counters, asked of the ranks between two iterations (blocks up to
        30 s): running and waiting requests, KV blocks and usage, prefix-cache counters, ..."""
        return self._executor.stats()

    def latest_stats(self) -> list[dict[str, Any]]:
        """The same counters as of each rank's latest heartbeat (a fraction of a second old);
        never blocks, also while the engine is stalled."""
        return self._executor.latest_stats()

    def control(self, op: str, timeout: float = 30.0, args: dict[str, Any] | None = None) -> ControlResult:
        """Run an inspection op on every rank between iterations ("check_integrity", "stats",
        "timing:on" / "timing" / "timing:off", "trace:on" / "trace:off" (the loop's
        marks, stamped), "profile:start" / "profile:stop" (args ``trace``:
        a Chrome trace path), "hostprofile:start" / "hostprofile:stop" (cProfile of the loop's
        thread; args ``top``, ``sort``); fault injection for tests). Returns each rank's answer."""
        return self._executor.control(op, timeout, args)

    def check_integrity(self) -> list[str]:
        """KV-cache integrity on every rank; raises AssertionError naming the failing ranks."""
        return self._executor.check_integrity()

    # -- rollout: what RL trainers call (pyexecutor/rollout.py) ----------------------------------------
    def pause_generation(self, mode: str = "abort", timeout: float = 600.0) -> None:
        """Stop generating. ``abort``: every unfinished request ends now with the tokens it has
        (finish reason "abort"; resend prompt + tokens to go on); ``wait``: nothing new starts,
        returns once the running requests have finished; ``keep``: no step runs, running requests
        keep their state and go on after ``continue_generation``. New requests wait meanwhile."""
        self._rollout("pause", {"mode": mode})
        if mode == "wait":   # the ranks' heartbeats say when: no control op (and its broadcast) per poll
            deadline = time.monotonic() + timeout
            while not ((beats := self.latest_stats()) and
                       all(s.get("paused") == "wait" and s["num_running"] == 0 for s in beats)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"pause_generation(mode='wait'): requests still running after {timeout}s")
                time.sleep(0.02)

    def continue_generation(self) -> None:
        """Undo ``pause_generation``: waiting and kept requests go on."""
        self._rollout("continue", {})

    def sleep(self, level: int = 1, timeout: float = 600.0) -> None:
        """Give the device memory back (engine idle: pause_generation('abort') first if needed):
        the KV cache and CUDA graphs always; the weights to host memory (level 1) or dropped
        (level 2: load new ones before generating)."""
        self._rollout("sleep", {"level": level}, timeout)

    def wake_up(self, tags: list[str] | None = None, timeout: float = 600.0) -> None:
        """Take the memory back: ``tags`` "weights" and/or "kv_cache" (default both; e.g. the
        weights first, update them, then the KV cache)."""
        self._rollout("wake_up", {"tags": tags}, timeout)

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (``sleep``), in part or wholly (API.md: a method, as vLLM's)."""
        import json
        return bool(json.loads(self._rollout("is_sleeping", {})[0]))

    @property
    def weight_version(self) -> str:
        """The version of the weights now served ("0" at start, then the caller's string or a
        counter per update); every output says which version produced its tokens."""
        return self._rollout("weight_version", {})[0]

    def update_weights_from_disk(self, path: str, weight_version: str | None = None, timeout: float = 600.0) -> str:
        """Load the weights of the checkpoint at ``path`` (a Hugging Face directory or a GGUF
        file of the same architecture). Returns the new weight version."""
        return self._update({"source": "disk", "path": path}, weight_version, timeout)

    def update_weights_from_tensors(self, named_tensors: Any, weight_version: str | None = None,
                                    timeout: float = 600.0) -> str:
        """Load ``(name, tensor)`` pairs or a ``{name: tensor}`` dict (Hugging Face names, full
        shapes) of a trainer in this host's memory: CUDA tensors are read in place through CUDA
        IPC, CPU tensors through shared memory; nothing is pickled. Also takes the specs of
        ``weight_transfer.share_tensors``."""
        from phalanx.llmapi.weight_transfer import share_tensors
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if items and all(isinstance(i, dict) for i in items):
            return self._update({"source": "tensors", "specs": items}, weight_version, timeout)
        with share_tensors(items) as shared:
            return self._update({"source": "tensors", "specs": shared.specs}, weight_version, timeout)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  backend: str | None = None, timeout: float = 600.0) -> None:
        """Join a trainer's process group (``weight_transfer.TrainerGroup``, rank 0): engine rank
        r becomes rank ``rank_offset + r`` of ``world_size``. NCCL on GPUs, gloo on the CPU.
        Blocks until the trainer has joined too."""
        if self._executor.private_network:
            raise ValueError("init_weights_update_group: the ranks run in a private network namespace and cannot "
                             "reach the trainer; start the LLM with mpi_private_network=False")
        self._rollout("init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "backend": backend, "timeout": timeout}, timeout + 5)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: str | None = None, bucket_bytes: int | None = None,
                                        timeout: float = 600.0) -> str:
        """Receive tensors the trainer broadcasts (``TrainerGroup.send`` with the same tensors
        and bucket size, running at the same time). Returns the new weight version."""
        from phalanx.llmapi.weight_transfer import DEFAULT_BUCKET_BYTES

        def plain(x: Any) -> Any:   # as msgpack carries it; the ranks check it (and tell the trainer what is wrong)
            if isinstance(x, (str, bytes, int, float, bool)) or x is None:
                return x
            try:
                return [plain(i) for i in x]     # lists, tuples, dict keys, generators
            except TypeError:
                return repr(x)                   # not a list: the ranks refuse it by name

        return self._update({"source": "distributed", "names": plain(names), "dtypes": plain(dtypes),
                             "shapes": plain(shapes), "bucket_bytes": bucket_bytes or DEFAULT_BUCKET_BYTES},
                            weight_version, timeout)

    def destroy_weights_update_group(self) -> None:
        self._rollout("destroy_weights_update_group", {})

    # -- LoRA adapters held by the ranks (pyexecutor/lora.py) -------------------------------------------
    def add_lora(self, lora_request: LoRARequest, tensors: Any = None, peft_config: Any = None,
                 timeout: float = 600.0) -> bool:
        """Read an adapter on every rank now and hold it until ``remove_lora``: from
        ``lora_request.lora_path``, or — for an RL trainer that trains a LoRA — from ``tensors``
        (its PEFT state dict: ``{name: tensor}`` or pairs, CUDA tensors read in place through CUDA
        IPC, CPU tensors through shared memory; or ``weight_transfer.share_tensors``' specs) with
        ``peft_config`` (its ``peft.LoraConfig`` or that as a dict). Requests then name it by
        ``LoRARequest(name, id)``, no path. Adding again under the same id replaces its weights
        (refused while requests run with it) and starts its prefix cache anew.
        A ValueError names what cannot be served; nothing changes then."""
        from phalanx.llmapi.weight_transfer import share_tensors
        from phalanx.models.lora import plain_peft_config
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"add_lora: lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.args.lora is None:
            raise ValueError("add_lora: this LLM serves no LoRA adapters (start it with lora_config or "
                             "enable_lora=True)")
        args: dict[str, Any] = {"lora_name": lora_request.lora_name, "lora_int_id": lora_request.lora_int_id}
        if tensors is None:
            if peft_config is not None:
                raise ValueError("add_lora: peft_config goes with tensors (a directory holds its own)")
            if not lora_request.lora_path:
                raise ValueError("add_lora: give lora_request.lora_path or the adapter's tensors")
            self._rollout("add_lora", {**args, "lora_path": lora_request.lora_path}, timeout)
            return True
        if lora_request.lora_path:
            raise ValueError("add_lora: give lora_request.lora_path or the adapter's tensors, not both")
        if peft_config is None:
            raise ValueError("add_lora: the adapter's tensors need its peft_config (r, lora_alpha, ...)")
        config = plain_peft_config(peft_config)
        items = _adapter_tensors(tensors)
        given = isinstance(items[0], dict)   # specs: shared by the caller
        with contextlib.nullcontext() if given else share_tensors(items) as shared:
            specs = items if shared is None else shared.specs
            self._rollout("add_lora", {**args, "peft_config": config, "specs": specs}, timeout)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop holding an adapter ``add_lora`` added (requests running with it finish with it)."""
        self._rollout("remove_lora", {"lora_int_id": lora_int_id})
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters the ranks hold in host memory (added, or read for requests)."""
        import json
        return {a["lora_int_id"] for a in json.loads(self._rollout("list_loras", {})[0])}

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (nothing computed so far is reused)."""
        self._rollout("reset_prefix_cache", {})

    def _update(self, args: dict[str, Any], weight_version: str | None, timeout: float) -> str:
        import json
        if weight_version is not None:
            args["weight_version"] = weight_version
        return str(json.loads(self._rollout("update_weights", args, timeout)[0])["weight_version"])

    def _rollout(self, op: str, args: dict[str, Any], timeout: float = 60.0) -> list[str]:
        """Run a rollout op on every rank; a refusal raises ValueError with the rank's reason."""
        self._check_open()
        res = self._executor.control(op, timeout, args)
        if not res.ok:
            error = next(r for r in res.per_rank if r.startswith("error"))
            _, kind, reason = (error.split(": ", 2) + ["", ""])[:3]
            raise (ValueError if kind == "ValueError" else RuntimeError)(f"{op}: {reason or error}")
        return res.per_rank

    # -- lifecycle --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._executor.shutdown()
        _live.discard(self)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")


class _Background:
    """One call run on a thread of its own; ``result`` joins it and returns or raises as the
    call did."""

    def __init__(self, name: str, fn: Any, *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised by result()
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def raise_if_failed(self) -> None:
        """Raise the call's error if it has already failed (never waits)."""
        if not self._thread.is_alive() and self._error is not None:
            raise self._error

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _adapter_tensors(tensors: Any) -> list[Any]:
    """``add_lora``'s tensors as (name, tensor) pairs all on the CPU or all on CUDA, or specs
    (dicts); a ValueError naming what is not."""
    import torch
    try:
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    except TypeError:
        raise ValueError(f"add_lora: tensors must be a mapping or pairs of names and tensors, got "
                         f"{type(tensors).__name__}") from None
    if not items:
        raise ValueError("add_lora: tensors is empty")
    if all(isinstance(i, dict) for i in items):
        return items
    for i in items:
        pair = isinstance(i, (tuple, list)) and len(i) == 2
        if not (pair and isinstance(i[0], str) and isinstance(i[1], torch.Tensor)):
            got = f"{type(i[1]).__name__} for {i[0]!r}" if pair else type(i).__name__
            raise ValueError(f"add_lora: tensors must map names to tensors (or be weight_transfer.share_tensors' "
                             f"specs), got {got}")
    if len({t.is_cuda for _, t in items}) > 1:
        raise ValueError("add_lora: tensors must be all on CUDA or all on the CPU, not both")
    return items


def _is_single(inputs: Any) -> bool:
    if isinstance(inputs, (str, dict)):
        return True
    # (the first item tells: a prompt's ids are ints, which _prepare checks every one of)
    return isinstance(inputs, (list, tuple)) and len(inputs) > 0 and isinstance(inputs[0], int)


def _chat_messages(conv: Any) -> list[dict[str, Any]]:
    """One conversation's messages as templates take them: OpenAI's text parts joined by newlines
    (as vLLM joins them, and phalanx serve)."""
    if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
        raise ValueError(f"messages: a conversation is a list of message dicts, got {type(conv).__name__}")
    out = []
    for i, m in enumerate(conv):
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported "
                                 "({'type': 'text', 'text': ...})")
            m = dict(m, content="\n".join(p["text"] for p in content))
        out.append(m)
    return out


def _per_prompt(sp: Any, n: int) -> list[Any]:
    """One SamplingParams for all prompts, or a list of one per prompt (``_prepare`` refuses an
    item that is not a SamplingParams, by name)."""
    if not isinstance(sp, (list, tuple)):
        return [sp] * n
    sps = list(sp)
    if len(sps) != n:
        raise ValueError(f"sampling_params: got {len(sps)} for {n} prompts (give one, or one per prompt)")
    return sps


def _progress(items: list, enabled: bool, desc: str = "Processed prompts"):
    if not enabled:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, dynamic_ncols=True)


_live: weakref.WeakSet[LLM] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for llm in list(_live):
        with contextlib.suppress(Exception):
            llm.shutdown()
