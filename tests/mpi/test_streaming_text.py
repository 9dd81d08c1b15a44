"""Text streaming through the proxy and one rank: deltas add up to the final text; stop strings
spanning token boundaries cut exactly; nothing leaks into the stream."""

import asyncio

import pytest

from phalanx import LLM, SamplingParams

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def test_streams_add_up_and_stop_strings_cut_exactly(llm):
    questions = ["Describe the ocean in two sentences.", "List four animals.", "Why is the sky blue?"]
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    sp = SamplingParams(max_tokens=30)
    full = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
    stops = [t[len(t) // 2:len(t) // 2 + 6] for t in full]

    async def stream(p, stop):
        seen, deltas = [], ""
        async for out in llm.generate_async(p, SamplingParams(max_tokens=30, stop=stop), streaming=True):
            seen.append(out.outputs[0].text)
            deltas += out.outputs[0].text_diff
        return seen, deltas, out

    async def main():
        return await asyncio.gather(*(stream(p, s) for p, s in zip(prompts, stops, strict=True)))

    for (seen, deltas, out), text, stop in zip(asyncio.run(main()), full, stops, strict=True):
        expected = text[:text.find(stop)]
        assert deltas == expected == out.outputs[0].text
        assert all(stop not in s for s in seen)
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    llm._executor.check_integrity()
