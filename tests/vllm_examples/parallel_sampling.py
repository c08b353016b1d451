from minipaged import LLM, SamplingParams


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
    params = SamplingParams(n=3, temperature=0.9, max_tokens=6, seed=0)
    for out in llm.generate(["Once upon a time,"], params):
        for i, c in enumerate(out.outputs):
            print(i, repr(c.text))
        assert len(out.outputs) == 3


if __name__ == "__main__":
    main()
