"""How the model continues a sequence of token ids without the host waiting on the device.

Each new token is drawn on the device (temperature, top-k, then Gumbel-max sampling) and
appended there, so the loop only queues work; the caller reads the ids back once, at the end
(``gpuflow sample`` does).
"""

from __future__ import annotations

import torch

from gpuflow.model.gpt import GPT


@torch.no_grad()
def generate_no_sync(
    model: GPT, idx: torch.Tensor, max_tokens: int, temperature: float, top_k: int
) -> torch.Tensor:
    """Extend ``idx`` (1, t) by ``max_tokens`` tokens, entirely on the device. ``temperature``
    0 picks the most likely token every time; ``top_k`` 0 samples from the whole vocabulary.
    The context slides: each token sees at most the last ``model.config.max_len``."""
    max_len = model.config.max_len
    for _ in range(max_tokens):
        logits = model.next_token_logits(idx[:, -max_len:])  # (1, V)
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            # Gumbel-max: argmax(log p - log E), E ~ Exp(1), samples from p with no host sync.
            noise = torch.empty_like(logits).exponential_()
            next_id = (logits.log_softmax(-1) - noise.log()).argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)  # (1, t + 1)
    return idx
