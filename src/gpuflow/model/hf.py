"""Which Hugging Face ``transformers`` GPT-2 computes what gpuflow's GPT computes: its
``config.json`` and its tensors, named and laid out as ``GPT2LMHeadModel`` loads them.

gpuflow's GPT is GPT-2's architecture less its biases: learned positions, pre-LayerNorm
blocks, exact GELU (``activation_function="gelu"``), a head tied to the token table. Every
bias GPT-2 has is written as zeros; the fused q/k/v, the attention's projection and the MLP's
weights are transposed into GPT-2's ``Conv1D`` layout. Nothing here needs ``transformers``;
``gpuflow.interface.export`` writes the folder it loads.
"""

from __future__ import annotations

import torch

from gpuflow.model.gpt import GPT, ModelConfig

# GPT-2's Conv1D layers and the nn.Linear of gpuflow's blocks each one is made from
CONV1D_OF_LINEAR = (
    ("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
    ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj"),
)  # fmt: skip


def gpt2_config(model: ModelConfig, eot: int) -> dict:
    """``config.json`` of the GPT-2 that computes what ``model`` does; ``eot``: the id of
    ``<|endoftext|>``, its first and last token."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.max_len,
        "n_embd": model.d_model,
        "n_layer": model.n_layer,
        "n_head": model.n_head,
        "n_inner": 4 * model.d_model,
        "activation_function": "gelu",  # torch's exact GELU, as gpuflow's MLP
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    }


def gpt2_weights(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-2's tensors (``transformer.*``; the head is tied) from gpuflow's GPT, in fp32."""
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    C = model.config.d_model  # GPT-2's biases, which gpuflow lacks, as zeros of their own:
    # safetensors refuses tensors that share memory
    out = {
        "transformer.wte.weight": state["wte.weight"],
        "transformer.wpe.weight": state["wpe.weight"],
        "transformer.ln_f.weight": state["ln_f.weight"],
        "transformer.ln_f.bias": torch.zeros(C),
    }
    for i in range(model.config.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            out[f"{theirs}{norm}.weight"] = state[f"{ours}{norm}.weight"]
            out[f"{theirs}{norm}.bias"] = torch.zeros(C)
        for conv, linear in CONV1D_OF_LINEAR:  # Conv1D keeps (in, out): Linear's transposed
            weight = state[f"{ours}{linear}.weight"]  # (out, in)
            out[f"{theirs}{conv}.weight"] = weight.t()
            out[f"{theirs}{conv}.bias"] = torch.zeros(weight.shape[0])
    return {k: v.contiguous() for k, v in out.items()}
