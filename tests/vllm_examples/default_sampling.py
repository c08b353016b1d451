from minipaged import LLM

questions = ["Hello, my name is", "The capital of France is"]


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", generation_config="vllm")
    params = llm.get_default_sampling_params()
    params.max_tokens = 6
    for out in llm.generate(questions, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
