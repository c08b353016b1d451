from minipaged import LLM, EngineArgs
from minipaged.utils import FlexibleArgumentParser


def make_parser():
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model="HuggingFaceTB/SmolLM2-135M-Instruct")
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int)
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-p", type=float)
    group.add_argument("--top-k", type=int)
    return parser


def main(args: dict):
    sampling = {k: args.pop(k) for k in ("max_tokens", "temperature", "top_p", "top_k")}
    llm = LLM(**args)
    params = llm.get_default_sampling_params()
    for k, v in sampling.items():
        if v is not None:
            setattr(params, k, v)
    for out in llm.generate(["Hello, my name is", "The sky is"], params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r}")


if __name__ == "__main__":
    main(vars(make_parser().parse_args(["--max_tokens", "6", "--temperature", "0"])))
