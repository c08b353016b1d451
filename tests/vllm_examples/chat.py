from minipaged import LLM, SamplingParams


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
    params = SamplingParams(temperature=0.5, max_tokens=8)
    talk = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a short line about paging."},
    ]
    print(llm.chat(talk, params, use_tqdm=False)[0].outputs[0].text)
    for out in llm.chat([talk] * 3, params, use_tqdm=True):
        print(out.outputs[0].text)


if __name__ == "__main__":
    main()
