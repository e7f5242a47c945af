"""vLLM's CPU build as a peer in bench/throughput.py: both ends of one JSON-lines pipe.

The driver half runs under .venv-vllm (made by bench/vllm_env.sh), loads vLLM's offline
engine once and times runs on request, so its first-start compile happens once per
invocation. The client half (`VllmPeer`, `save_hf_dir`) runs under the project's .venv and
imports nothing from vLLM.

    bash bench/vllm_env.sh
    .venv/bin/python bench/throughput.py --with-vllm      # starts this file as the driver
    .venv-vllm/bin/python bench/vllm_peer.py MODEL_DIR --dtype float32   # the driver alone

Protocol: the driver writes {"ready": true, "version": ...} once loaded; then each line it
reads is {"prompts": [...], "single": "...", "max_tokens": N} and it answers one line with the
figures HfBaseline.run() returns; with "batch_only": true in the request, only the batch's
("batch_tok_s", "batch_wall_s"; bench/host_ceiling.py). The first run starts with an untimed
warm-up. EOF on stdin ends it. vLLM logs to stdout, so the driver moves its own fd 1 onto
stderr and keeps a private copy for the protocol.

Single stream: the request goes to the engine's step API (LLM.llm_engine), which hands back
each token as its step finishes; TTFT = time from add_request to the first token, decode
tokens/s = (tokens - 1) / (total - TTFT), as for the other systems. Batch: LLM.generate() on
every prompt at once, wall time, prefill included.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

# KV cache for the driver, in GiB: the workload needs 64 x 255 tokens, about 0.75 GiB in fp32.
KV_CACHE_GIB = 2
MAX_MODEL_LEN = 1024


def save_hf_dir(gguf_path: Path, out_dir: Path) -> Path:
    """Writes the GGUF's weights, dequantized to float32, as an HF directory (config.json,
    safetensors, tokenizer) once; vLLM then runs exactly the weights the others run."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # The tensors are already dense; this drops only the GGUF marker that blocks saving.
    model.hf_quantizer.remove_quantization_config(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(out_dir)  # the directory appears only complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


class VllmPeer:
    """One driver process under .venv-vllm, loaded at construction; `run()` times one round
    with the same keys as HfBaseline.run()."""

    def __init__(self, python: Path, model_dir: Path, dtype: str, log_dir: Path,
                 kv_cache_dtype: str = "auto") -> None:
        self.log_path = log_dir / f"vllm-{dtype}-{kv_cache_dtype}.log"
        start = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [str(python), __file__, str(model_dir), "--dtype", dtype,
                 "--kv-cache-dtype", kv_cache_dtype],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.version = str(self._read()["version"])
        self.start_s = time.perf_counter() - start

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM driver exited ({self.proc.wait()}); see {self.log_path}")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, prompts: list[str], single: str, max_tokens: int,
            batch_only: bool = False) -> dict[str, float]:
        """One round; `batch_only`: without the single stream (the batch's figures only)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(
            {"prompts": prompts, "single": single, "max_tokens": max_tokens,
             "batch_only": batch_only}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_single(llm: Any, prompt: str, max_tokens: int) -> tuple[int, float, float]:
    """(tokens, seconds to first token, seconds in all) for one request on the step API."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"single-{start}", prompt, params)
    first, num_tokens = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_tokens = len(out.outputs[0].token_ids)
            if num_tokens and first is None:
                first = time.perf_counter() - start
    return num_tokens, first or 0.0, time.perf_counter() - start


def run_batch(llm: Any, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) for every prompt submitted at once."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert counts == [max_tokens] * len(prompts), counts
    return sum(counts), wall


def serve(model_dir: str, dtype: str, proto: IO[str], kv_cache_dtype: str = "auto") -> None:
    import vllm

    llm = vllm.LLM(model=model_dir, dtype=dtype, max_model_len=MAX_MODEL_LEN, seed=0,
                   generation_config="vllm", kv_cache_dtype=kv_cache_dtype)
    proto.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    proto.flush()
    warm = False
    for line in sys.stdin:
        req = json.loads(line)
        prompts, single, max_tokens = req["prompts"], req["single"], req["max_tokens"]
        if not warm:
            run_batch(llm, prompts[:8], 16)
            run_single(llm, single, 16)
            warm = True
        figures: dict[str, float] = {}
        if not req.get("batch_only"):
            n, ttft, total = run_single(llm, single, max_tokens)
            figures = {"single_ttft_ms": ttft * 1000,
                       "single_decode_tok_s": (n - 1) / (total - ttft)}
        count, wall = run_batch(llm, prompts, max_tokens)
        proto.write(json.dumps({"batch_tok_s": count / wall, "batch_wall_s": wall,
                                **figures}) + "\n")
        proto.flush()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   default="auto", help="vLLM's --kv-cache-dtype (its CPU build: AVX-512 only)")
    a = p.parse_args()
    # Every core this process may use; vLLM's default binding leaves one idle.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                          ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    serve(a.model_dir, a.dtype, proto, a.kv_cache_dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
