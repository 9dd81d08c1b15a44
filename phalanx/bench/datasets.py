"""Request generators for ``phalanx bench serve``. Each yields ``BenchRequest``s with exact
token lengths (prompts as token ids; text is derived when the endpoint needs it)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field


@dataclass
class BenchRequest:
    prompt_ids: list[int] | None          # exact token ids (None for JSONL text prompts)
    output_len: int
    text: str | None = None
    group: int = -1                       # shared-prefix group / conversation
    turn: int = 0
    messages: list[dict] | None = field(default=None, repr=False)


def _ids(rng: random.Random, n: int, vocab: int, lo: int) -> list[int]:
    return [rng.randrange(lo, vocab) for _ in range(n)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                    seed: int = 0, lo: int = 1000) -> list[BenchRequest]:
    """ISL/OSL drawn uniformly from [len·(1−r), len·(1+r)] (r = range_ratio; 0 = fixed)."""
    rng = random.Random(seed)
    lo = min(lo, vocab // 4)

    def draw(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [BenchRequest(_ids(rng, draw(input_len), vocab, lo), draw(output_len)) for _ in range(num)]


def shared_prefix_requests(groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
                           vocab: int, seed: int = 0, lo: int = 1000) -> list[BenchRequest]:
    """``groups`` system prompts of ``system_len`` tokens, each followed by ``per_group``
    different questions of ``question_len`` tokens (like SGLang's generated-shared-prefix)."""
    rng = random.Random(seed)
    lo = min(lo, vocab // 4)
    out = []
    for g in range(groups):
        system = _ids(rng, system_len, vocab, lo)
        out += [BenchRequest(system + _ids(rng, question_len, vocab, lo), output_len, group=g)
                for _ in range(per_group)]
    rng.shuffle(out)
    return out


def multi_turn_requests(conversations: int, turns: int, first_len: int, user_len: int, output_len: int,
                        vocab: int, seed: int = 0, lo: int = 1000) -> list[list[BenchRequest]]:
    """Conversations that resend their history: turn t's prompt is turn t−1's prompt, then the
    assistant's reply (filled in when it arrives), then ``user_len`` new tokens. Returns one list
    of turns per conversation; the client sends a conversation's turns in order."""
    rng = random.Random(seed)
    lo = min(lo, vocab // 4)
    return [[BenchRequest(_ids(rng, first_len if t == 0 else user_len, vocab, lo), output_len, group=c, turn=t)
             for t in range(turns)] for c in range(conversations)]


def jsonl_requests(path: str, output_len: int, limit: int | None = None) -> list[BenchRequest]:
    """One JSON object per line with "prompt" (text) and optionally "output_len"."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            out.append(BenchRequest(None, int(obj.get("output_len", output_len)), text=obj["prompt"]))
            if limit and len(out) >= limit:
                break
    return out
