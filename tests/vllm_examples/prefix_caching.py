from minipaged import LLM, SamplingParams
from minipaged.distributed import cleanup_dist_env_and_memory

shared = ("You are a careful teacher at a school for engineers. Explain each answer in one sentence, "
          "with one number in it. Here is the question: ")
questions = ["Why are KV blocks fixed-size?", "What does a block table map?", "When is a block freed?"]
prompts = [shared + q for q in questions]
params = SamplingParams(temperature=0.0, max_tokens=8)


def main():
    plain = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", enable_prefix_caching=False, gpu_memory_utilization=0.4)
    first = [o.outputs[0].text for o in plain.generate(prompts, params)]
    del plain
    cleanup_dist_env_and_memory()
    cached = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", enable_prefix_caching=True, gpu_memory_utilization=0.4)
    cached.generate(prompts[0], params)  # warm the cache with the shared part
    second = [o.outputs[0].text for o in cached.generate(prompts, params)]
    print("same answers:", first == second)
    assert first == second


if __name__ == "__main__":
    main()
