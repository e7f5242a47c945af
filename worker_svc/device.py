"""Where a worker computes: `--device auto|cpu|cuda|cuda:N`, resolved once at start.

`auto` is CUDA when torch sees a GPU, else the CPU. `cuda` means the first visible GPU
(`CUDA_VISIBLE_DEVICES` decides which that is); `cuda:N` the N-th visible one. A CUDA device
that is not there is refused at start with the reason, never silently replaced by the CPU.

On CUDA everything a step touches stays on the GPU (weights, KV cache, activations, logits,
sampling); only the sampled token ids (and logprobs when asked) come back, once per step.
"""

import torch

# What each device computes in (RegisterResponse.dtype). The CPU's C kernels take float32 and
# bfloat16; float16 has no fast CPU path and is refused there rather than run slowly.
CPU_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CUDA_DTYPES = {**CPU_DTYPES, "float16": torch.float16}


class DeviceError(ValueError):
    """The requested device cannot be used here."""


def resolve_device(spec: str, cuda_count: int | None = None) -> torch.device:
    """`spec` -> a concrete torch.device. `cuda_count`: visible GPUs (None: ask torch; tests
    pass a number to check the rules without a GPU)."""
    spec = spec.strip().lower()
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return torch.device("cuda", 0) if cuda_count else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        index_text = spec.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise DeviceError(f"--device {spec!r}: expected cuda:N with N a GPU index")
        index = int(index_text)
        if cuda_count == 0:
            raise DeviceError(f"--device {spec}: torch sees no CUDA GPU here (torch "
                              f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                              f"use --device cpu")
        if index >= cuda_count:
            raise DeviceError(f"--device {spec}: only {cuda_count} GPU(s) are visible "
                              f"(indices 0..{cuda_count - 1})")
        return torch.device("cuda", index)
    raise DeviceError(f"--device {spec!r}: expected auto, cpu, cuda or cuda:N")


def dtype_for(device: torch.device, name: str) -> torch.dtype:
    """The torch dtype a replica's dtype name means on this device; refuses what it cannot
    compute (float16 on a CPU)."""
    table = CUDA_DTYPES if device.type == "cuda" else CPU_DTYPES
    if name not in table:
        raise DeviceError(f"dtype {name!r} is not supported on {device.type} "
                          f"(choose from {', '.join(table)})")
    return table[name]


def device_label(device: torch.device) -> str:
    """'cpu' or 'cuda:N' (RegisterRequest.device)."""
    return "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"


def device_uuid(device: torch.device) -> str:
    """The GPU's identity (the same physical GPU gives the same string in every process,
    whatever CUDA_VISIBLE_DEVICES says); '' on the CPU."""
    if device.type != "cuda":
        return ""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return "" if uuid is None else f"GPU-{uuid}"


def describe(device: torch.device) -> str:
    if device.type != "cuda":
        return "device cpu"
    props = torch.cuda.get_device_properties(device)
    return (f"device {device_label(device)}: {props.name}, {props.total_memory / (1 << 30):.1f} "
            f"GiB, compute capability {props.major}.{props.minor}, torch {torch.__version__}")
