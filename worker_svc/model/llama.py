"""Llama-family decoder for one pipeline stage: layers [first_layer, end_layer).

The embedding lives on the first stage, the final norm and LM head on the last. A stage takes
token ids (first stage) or the previous stage's `(hidden_states, residual)` and returns
`(hidden_states, residual)` of its last layer; the last stage then calls `compute_logits` on
the rows it samples. The residual stream travels un-normed beside the hidden states so that
every norm is "add, then RMSNorm" (the layout pipeline stages pass along).

Weights are plain tensors (no nn.Module) to keep per-layer Python overhead small: q/k/v are one
matmul and gate/up another (`Linear`, worker_svc.model.linear). Under tensor parallelism a
rank holds the slices `TpShard` gives it (its heads, its part of the MLP and of the
vocabulary; see model/tensor_parallel.py) and sums
the row-parallel outputs (o_proj, down_proj, the embedding) over its `TpGroup`.
RoPE follows HF's non-interleaved convention: dimension i pairs with i + head_dim/2; its
tables carry the model's frequency rule (model/rope.py). The families' variations are in the
layer: q/k/v (and o_proj) biases, sliced with their heads under TP, and Qwen3's per-head q/k
RMSNorm (replicated) before RoPE. Each layer attends within its own window (`window`, 0 =
full, from `ModelConfig.layer_windows`): every attention kernel takes it and reads no key
before it. Layers of one kind form a KV group (services.kv_groups): a layer reads its group's
block table (`forward` takes one metadata per group) and the KV tensor of its position in the
group, which the layers at that position in the other groups share.

Small batches are memory-bound on CPU: a decode step of one request reads every weight once.
Matrices that the GGUF stores as Q4_0/Q4_1/Q8_0 also keep their blocks, and steps of a few
tokens multiply on those (a fifth of float32's bytes; see worker_svc.kernels.gemm); at level
amx in float32 every step does, on AMX tiles (worker_svc.kernels.gemm_amx_quant).
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from services.kv_groups import KvGroupLayout
from services.model_config import ModelConfig
from worker_svc.attention import AttentionMetadata, paged_attention
from worker_svc.kernels import CpuLevel, ElementwiseKernels, LayerKernels
from worker_svc.kernels.elementwise import (  # noqa: F401  (the torch twins, re-exported)
    TorchElementwise,
    apply_rotary,
    rotary_rows,
)
from worker_svc.kernels.kv_quant import KvScales
from worker_svc.model.linear import Linear, linear_from
from worker_svc.model.rope import RotaryEmbedding
from worker_svc.model.tensor_parallel import TpGroup, TpShard, slice_rows
from worker_svc.model.weights import ModelWeights


def elementwise_ops(kernels: LayerKernels) -> "ElementwiseKernels | TorchElementwise":
    """The elementwise C kernels, or their torch twin where they did not build."""
    return kernels.elementwise or TorchElementwise()


class LlamaLayer:
    """One decoder layer's weights and forward."""

    __slots__ = ("num_heads", "num_kv_heads", "head_dim", "eps", "input_norm", "qkv_proj",
                 "qkv_bias", "q_norm", "k_norm", "o_proj", "o_bias", "post_attention_norm",
                 "gate_up_proj", "down_proj", "tp", "rotary", "kernels", "elementwise",
                 "window", "kv_scales")

    def __init__(self, shard: TpShard, config: ModelConfig, weights: ModelWeights, layer: int,
                 rotary: RotaryEmbedding, tp: TpGroup | None = None,
                 kernels: LayerKernels | None = None, kv_scales: KvScales | None = None):
        """`shard`: the heads and MLP slice this rank holds (all of them without TP).
        `kernels`: the C kernels that built (None or None fields: torch ops). `kv_scales`:
        an 8-bit KV cache's scales (worker_svc.kernels.kv_quant; the kernels hold the same)."""
        head_dim = config.head_dim
        self.num_heads = shard.num_heads         # this rank's
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = head_dim
        self.eps = config.rms_norm_eps
        self.tp = tp
        self.rotary = rotary
        self.window = config.layer_windows[layer]   # tokens a query reads back; 0 = all
        self.kv_scales = kv_scales
        self.kernels = kernels or LayerKernels(CpuLevel.NONE)
        self.elementwise = elementwise_ops(self.kernels)
        prefix = f"model.layers.{layer}."
        tensors = weights.tensors
        self.input_norm = tensors[prefix + "input_layernorm.weight"]
        q0, q1 = (h * head_dim for h in shard.q_heads)
        kv0, kv1 = (h * head_dim for h in shard.kv_heads)
        i0, i1 = shard.intermediate
        attn = prefix + "self_attn."
        kern = self.kernels
        self.qkv_proj = linear_from(weights, [(attn + "q_proj.weight", "rows", q0, q1),
                                          (attn + "k_proj.weight", "rows", kv0, kv1),
                                          (attn + "v_proj.weight", "rows", kv0, kv1)], kern)
        # [(h + 2 * kv_h) * dim, hidden]
        self.qkv_bias: torch.Tensor | None = None          # [(h + 2 * kv_h) * dim]
        if config.attention_bias:
            self.qkv_bias = torch.cat([slice_rows(tensors[attn + "q_proj.bias"], q0, q1),
                                       slice_rows(tensors[attn + "k_proj.bias"], kv0, kv1),
                                       slice_rows(tensors[attn + "v_proj.bias"], kv0, kv1)])
        self.q_norm: torch.Tensor | None = None            # [head_dim], every rank
        self.k_norm: torch.Tensor | None = None
        if config.qk_norm:
            self.q_norm = tensors[attn + "q_norm.weight"]
            self.k_norm = tensors[attn + "k_norm.weight"]
        self.o_proj = linear_from(weights, [(attn + "o_proj.weight", "cols", q0, q1)], kern)
        # [hidden]: added once, after the all-reduce of the partial sums
        self.o_bias = tensors[attn + "o_proj.bias"] if config.o_proj_bias else None
        self.post_attention_norm = tensors[prefix + "post_attention_layernorm.weight"]
        self.gate_up_proj = linear_from(weights, [(prefix + "mlp.gate_proj.weight", "rows", i0, i1),
                                              (prefix + "mlp.up_proj.weight", "rows", i0, i1)],
                                     kern)
        # [2 * inter, hidden]
        self.down_proj = linear_from(weights, [(prefix + "mlp.down_proj.weight", "cols", i0, i1)],
                                 kern)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: [num_tokens, hidden_size] (residual None on the first layer);
        positions [num_tokens]."""
        num_tokens = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        ew = self.elementwise
        residual, x = ew.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        qkv = self.qkv_proj(x)                             # [num_tokens, (heads+2*kv_heads)*dim]
        if self.qkv_bias is not None:
            qkv += self.qkv_bias
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads(qkv, 0, heads, self.q_norm)
            self._norm_heads(qkv, heads, kv_heads, self.k_norm)
        ew.rotary_(qkv, heads + kv_heads, dim, positions, self.rotary.cos, self.rotary.sin)
        q = qkv[:, :heads * dim].view(num_tokens, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim:].view(num_tokens, kv_heads, dim)
        attn = paged_attention(q, k, v, kv_cache, meta,    # [num_tokens, heads*dim]
                               self.kernels.attention, window=self.window,
                               scales=self.kv_scales)
        hidden = self.o_proj(attn)                         # [num_tokens, hidden_size]
        if self.tp is not None:
            self.tp.all_reduce(hidden)                     # partial sums over the heads
        if self.o_bias is not None:
            hidden += self.o_bias

        residual, x = ew.add_rms_norm(hidden, residual, self.post_attention_norm, self.eps)
        gate_up = self.gate_up_proj(x)                     # [num_tokens, 2*intermediate]
        hidden = self.down_proj(ew.silu_mul(gate_up))      # [num_tokens, hidden_size]
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        return hidden, residual

    def _norm_heads(self, qkv: torch.Tensor, first_head: int, num_heads: int,
                    weight: torch.Tensor) -> None:
        """RMSNorm, in place, of each of heads [first_head, first_head + num_heads) of the
        qkv rows, over its head_dim values (Qwen3's q_norm / k_norm)."""
        dim = self.head_dim
        cols = qkv[:, first_head * dim:(first_head + num_heads) * dim]
        # The kernels take contiguous rows: one copy of these heads, one row per head (a
        # single head's reshape is a strided view, hence contiguous()).
        rows = cols.reshape(-1, dim).contiguous()          # [num_tokens * num_heads, dim]
        _, normed = self.elementwise.add_rms_norm(rows, None, weight, self.eps)
        cols.copy_(normed.view(cols.shape))


class LlamaModel:
    """The layers of one pipeline stage, plus embedding (first) and norm + head (last), as
    held by one TP rank (`tp` None: the whole width)."""

    __slots__ = ("config", "dtype", "device", "first_layer", "end_layer", "is_last_stage",
                 "shard", "tp", "embed_tokens", "layers", "norm", "lm_head", "rotary",
                 "kernels", "elementwise", "kv_layout", "layer_groups", "layer_positions",
                 "kv_scales")

    def __init__(self, config: ModelConfig, dtype: torch.dtype, first_layer: int = 0,
                 end_layer: int | None = None, is_last_stage: bool = True,
                 tp: TpGroup | None = None, device: torch.device | None = None, *,
                 kernels: LayerKernels, kv_scales: KvScales | None = None):
        """`device`: where weights, tables and activations live (default the CPU).
        `kernels`: the layers' kernel set, chosen by worker_svc.kernel_choice; where a field
        is None (level none, or a kernel that did not build) its torch twin runs (same
        results, slower). `kv_scales`: an 8-bit KV cache's (worker_svc.kernels.kv_quant)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else device
        self.first_layer = first_layer
        self.end_layer = config.num_layers if end_layer is None else end_layer
        self.is_last_stage = is_last_stage
        self.tp = tp
        self.shard = tp.shard if tp is not None else TpShard.whole(
            config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size)
        self.embed_tokens: torch.Tensor | None = None   # [vocab slice, hidden], first stage
        self.layers: list[LlamaLayer] = []
        self.norm: torch.Tensor | None = None           # [hidden], last stage
        self.lm_head: Linear | None = None              # [vocab slice, hidden], last stage
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_model_len,
                                      dtype, self.device, config.rope_scaling)
        self.kernels = kernels
        self.kv_scales = kv_scales
        self.elementwise = elementwise_ops(self.kernels)
        # KV groups (services.kv_groups): each layer of this stage reads its group's block
        # table and writes the KV tensor of its position (shared with the layers of the same
        # position in the other groups).
        self.kv_layout = KvGroupLayout.from_windows(config.layer_windows)
        stage_layers = range(self.first_layer, self.end_layer)
        self.layer_groups = tuple(self.kv_layout.group_of(i) for i in stage_layers)
        self.layer_positions = tuple(self.kv_layout.position_of(i) for i in stage_layers)

    @property
    def is_first_stage(self) -> bool:
        return self.first_layer == 0

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """This stage's layers' attention windows, in order (0: full; see `LlamaLayer.window`)."""
        return self.config.layer_windows[self.first_layer:self.end_layer]

    def load_weights(self, weights: ModelWeights) -> None:
        """Take HF-named weights (see `weights.load_weights`) already in `self.dtype` and on
        `self.device`."""
        cfg = self.config
        tensors = weights.tensors
        v0, v1 = self.shard.vocab
        try:
            if self.is_first_stage:
                self.embed_tokens = slice_rows(tensors["model.embed_tokens.weight"], v0, v1)
            self.layers = [
                LlamaLayer(self.shard, cfg, weights, i, self.rotary, self.tp, self.kernels,
                           self.kv_scales)
                for i in range(self.first_layer, self.end_layer)]
            if self.is_last_stage:
                self.norm = tensors["model.norm.weight"]
                head = ("model.embed_tokens.weight" if cfg.tie_word_embeddings
                        else "lm_head.weight")
                self.lm_head = linear_from(weights, [(head, "rows", v0, v1)], self.kernels)
        except KeyError as missing:
            raise ValueError(f"weights missing tensor {missing}") from None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids -> [num_tokens, hidden]; with TP, each rank looks up the ids in its
        vocabulary slice, zeros the others, and the all-reduce adds the one real row."""
        assert self.embed_tokens is not None
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        v0, v1 = self.shard.vocab
        outside = (input_ids < v0) | (input_ids >= v1)
        hidden = F.embedding((input_ids - v0).masked_fill_(outside, 0), self.embed_tokens)
        hidden.masked_fill_(outside.unsqueeze(1), 0)
        return self.tp.all_reduce(hidden)

    def forward(self, input_ids: torch.Tensor | None, hidden_states: torch.Tensor | None,
                residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata | Sequence[AttentionMetadata],
                kv_caches: list[torch.Tensor],
                wait_layer: Callable[[int], None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """First stage: input_ids [num_tokens]; later stages: hidden_states and residual
        [num_tokens, hidden_size] from the previous stage. meta: one per KV group (a layer
        takes its group's, `layer_groups`), or one for every layer. kv_caches: one per layer
        of this stage (layers of one tensor position share one). `wait_layer(i)` is called
        before layer i (of this stage) runs: a layer-wise KV load's wait for that layer's KV
        (worker_svc.load_ticket). Returns (hidden_states, residual), both [num_tokens,
        hidden_size]."""
        if self.is_first_stage:
            assert input_ids is not None
            hidden_states = self.embed(input_ids)                       # [num_tokens, hidden]
            residual = None
        assert hidden_states is not None
        metas = ([meta] * len(self.layers) if isinstance(meta, AttentionMetadata)
                 else [meta[group] for group in self.layer_groups])
        for i, (layer, layer_meta, kv_cache) in enumerate(
                zip(self.layers, metas, kv_caches, strict=True)):
            if wait_layer is not None:
                wait_layer(i)
            hidden_states, residual = layer.forward(hidden_states, residual, positions,
                                                    layer_meta, kv_cache)
        assert residual is not None
        return hidden_states, residual

    def compute_logits(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Last stage: final norm and LM head on the given rows -> [rows, vocab], model dtype
        (the full vocabulary on every TP rank)."""
        assert self.norm is not None and self.lm_head is not None
        _, x = self.elementwise.add_rms_norm(hidden_states, residual, self.norm,
                                             self.config.rms_norm_eps)
        logits = self.lm_head(x)
        return logits if self.tp is None else self.tp.gather_vocab(logits)
