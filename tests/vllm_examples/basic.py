from minipaged import LLM, SamplingParams

questions = ["Hello, my name is", "The capital of France is", "The future of AI is"]
params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
    for out in llm.generate(questions, params):
        print(f"prompt: {out.prompt!r} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
