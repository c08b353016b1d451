import random

from minipaged import LLM, SamplingParams

SEED = 42
questions = ["Hello, my name is", "The president of the United States is"]
params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6)


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", seed=SEED)
    for out in llm.generate(questions, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    print(random.randint(0, 100))  # the engine seeded Python's random too


if __name__ == "__main__":
    main()
