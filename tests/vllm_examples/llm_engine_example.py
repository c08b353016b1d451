from minipaged import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from minipaged.utils import FlexibleArgumentParser


def test_prompts():
    return [
        ("A robot may not harm", SamplingParams(temperature=0.0, max_tokens=6)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=6)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95, frequency_penalty=0.1, max_tokens=6)),
    ]


def process(engine: LLMEngine, work):
    request_id = 0
    while work or engine.has_unfinished_requests():
        if work:
            prompt, params = work.pop(0)
            engine.add_request(str(request_id), prompt, params)
            request_id += 1
        outs: list[RequestOutput] = engine.step()
        for out in outs:
            if out.finished:
                print(out.request_id, [c.text for c in out.outputs])


def main(args):
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    process(engine, test_prompts())


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="drive the engine step by step")
    parser = EngineArgs.add_cli_args(parser)
    main(parser.parse_args(["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]))
