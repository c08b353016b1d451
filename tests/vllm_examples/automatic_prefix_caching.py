import time

from minipaged import LLM, SamplingParams

TABLE = "\n".join(f"| {i} | item {i} | {i * 7 % 13} |" for i in range(40))
HEAD = "Here is a table of items and their scores:\n" + TABLE + "\n"


def ask(llm, question, params):
    t = time.time()
    out = llm.generate(HEAD + question, params)[0]
    print(f"{question!r} -> {out.outputs[0].text!r} in {time.time() - t:.2f}s")


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=6)
    ask(llm, "What is the score of item 3?", params)
    ask(llm, "What is the score of item 9?", params)  # the table's blocks come from the cache


if __name__ == "__main__":
    main()
