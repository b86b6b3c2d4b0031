"""A GPT language model whose embedding lookup happens on the device.

Only token ids ever cross the bus: the token and position tables, the lookup and their sum
all live where the model lives (the fix the seed's trainer needed for its 768 MB of embedding
downloads per batch). Pre-LayerNorm blocks, causal attention (FlexAttention in a compiled
bf16 CUDA step with contexts up to 128 and heads up to 64 wide,
``scaled_dot_product_attention`` otherwise), a GELU MLP and an output head tied to the token
table, its cross-entropy fused with it (``gpuflow.model.head``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from gpuflow.common.errors import GpuflowError
from gpuflow.model.head import linear_cross_entropy


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 16000
    n_layer: int = 6
    n_head: int = 6
    d_model: int = 384
    max_len: int = 128  # context length; training windows are this long

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise GpuflowError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise GpuflowError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head "
                f"({self.n_head}); pick a head count that divides it"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# FlexAttention for short contexts and narrow heads: measured faster than cuDNN's attention
# at T 128 with heads of 64 (seed-d384), slower at T 1024. Wider heads also risk its backward
# kernel needing more shared memory than GPUs outside the A100/H100 class have
# (pytorch/pytorch#133254).
FLEX_MAX_LEN = 128
FLEX_MAX_HEAD_DIM = 64
# FlexAttention's kernel blocks for contexts that are whole 128-position blocks of its mask.
# Inductor's defaults (forward 128 x 128, backward 64/128/128/64) give T 128 one forward
# program per batch row and head, a wave and a half over an H100's SMs at seed-d384's batch;
# blocks of 64 (forward) and 32/64 (backward) fill the GPU (docs/decisions/028). Shorter
# contexts keep inductor's blocks: at T 32 these gave NaN losses once the step was captured.
FLEX_BLOCK = 128
FLEX_KERNEL_OPTIONS: dict[str, int | bool] = {
    "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
    "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
    "bwd_num_warps": 4, "bwd_num_stages": 3,
}  # fmt: skip
_causal_masks: dict[tuple[int, str], BlockMask] = {}


def _is_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q >= kv


def causal_block_mask(T: int, device: torch.device) -> BlockMask:
    """FlexAttention's block mask for causal attention over T positions (built once per T)."""
    key = (T, str(device))
    if key not in _causal_masks:
        _causal_masks[key] = create_block_mask(
            _is_causal, None, None, T, T, device=device, BLOCK_SIZE=FLEX_BLOCK
        )
    return _causal_masks[key]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        use_flex = (
            x.is_cuda
            and q.dtype == torch.bfloat16
            and T <= FLEX_MAX_LEN
            and C // self.n_head <= FLEX_MAX_HEAD_DIM
        )
        if use_flex and torch.compiler.is_compiling():
            # Compiled with the model into one Triton flash kernel per direction (measured in
            # bf16 only, so taken only there, which also keeps it to GPUs with bf16): faster
            # than cuDNN's attention and its helpers at T 128, slower at T 1024
            # (docs/decisions/011).
            y = flex_attention(
                q,
                k,
                v,
                block_mask=causal_block_mask(T, x.device),
                kernel_options=FLEX_KERNEL_OPTIONS if T % FLEX_BLOCK == 0 else None,
            )
        else:  # eagerly FlexAttention would build the whole score matrix
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=False)
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=False)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=False)
        self.register_buffer("positions", torch.arange(config.max_len), persistent=False)
        # Keep only each block's input for the backward and compute the rest again there
        # (activation checkpointing): less memory per sequence for one more forward's work.
        self.recompute_blocks = False
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings (B, T, C) of ids ``idx`` (B, T), T <= max_len."""
        T = idx.shape[1]
        return self.wte(idx) + self.wpe(self.positions[:T])  # the lookup is on-device

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, C) for token ids ``idx`` (B, T)."""
        return self.trunk(self.embed(idx))

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks and final norm on embeddings ``x`` (B, T, C).

        Under autocast the residual stream is carried in autocast's dtype: the blocks' matrix
        products emit it anyway, and an fp32 stream would double the bytes every residual add
        and LayerNorm moves (seed-d384 trains 2% faster in bf16, gpt2-124m 5.6%).
        """
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        recompute = self.recompute_blocks and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.ln_f(x)  # (B, T, C)

    def loss_from_embeddings(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``forward`` from embeddings computed elsewhere (the naive data path's host
        lookup): x (B, T, C), targets (B, T)."""
        return linear_cross_entropy(
            self.trunk(x).flatten(0, 1), self.wte.weight, targets.flatten()
        )  # head tied to wte

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32 scalar) of ``idx`` (B, T) against ``targets``."""
        return self.loss_from_embeddings(self.embed(idx), targets)

    def next_token_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for the token after ``idx`` (B, T): shape (B, V), in fp32."""
        return F.linear(self.hidden(idx)[:, -1, :], self.wte.weight).float()

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def flops_per_token(config: ModelConfig) -> int:
    """Training FLOPs per token: 6·N for the weights plus 12·L·d·T for attention.

    N counts every weight used in a matrix product, so the tied token table (it is the
    output head) is in and the position table (a lookup only) is out.
    """
    d, L, T, V = config.d_model, config.n_layer, config.max_len, config.vocab_size
    n_matmul_params = V * d + L * 12 * d * d
    return 6 * n_matmul_params + 12 * L * d * T


def check_state_shapes(
    expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], source: str
) -> None:
    """Refuse weights that belong to another model shape, naming the first difference."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has an unknown tensor {unexpected[0]}"
        raise GpuflowError(
            f"{source} does not fit this model: it {what}; it was saved by another model "
            "configuration"
        )
    for name, tensor in expected.items():
        if tuple(found[name].shape) != tuple(tensor.shape):
            raise GpuflowError(
                f"{source} holds {name} of shape {tuple(found[name].shape)} but this model's is "
                f"{tuple(tensor.shape)}: it was saved by another model configuration"
            )
