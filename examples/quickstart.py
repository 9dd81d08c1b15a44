"""Generate with the bundled SmolLM2-135M-Instruct: python examples/quickstart.py"""

from phalanx import LLM, SamplingParams


def main() -> None:
    with LLM() as llm:                       # model=None: the bundled GGUF
        questions = ["What is the capital of France?", "Give me three tips for staying focused."]
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0))
        for q, out in zip(questions, outs, strict=True):
            print(f"Q: {q}\nA: {out.outputs[0].text.strip()}\n")


if __name__ == "__main__":
    main()
