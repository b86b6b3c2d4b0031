"""How the model continues a sequence of token ids without the host waiting on the device.

Each new token is drawn on the device (temperature, top-k, then Gumbel-max sampling) and
written there into a buffer made once for the whole sequence, so the loop only queues work
and nothing is reallocated per token; the caller reads the ids back once, at the end
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
    start = idx.shape[1]
    out = idx.new_empty((idx.shape[0], start + max_tokens))  # (1, t + max_tokens)
    out[:, :start] = idx
    for end in range(start, start + max_tokens):
        logits = model.next_token_logits(out[:, max(0, end - max_len) : end])  # (1, V)
        out[:, end : end + 1] = next_token(logits, temperature, top_k)
    return out


def next_token(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The id (B, 1) drawn from ``logits`` (B, V) at ``temperature`` among the ``top_k``
    likeliest (0: all of them), on the device."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    if temperature < _SMALLEST_SAFE:
        # Dividing by so small a temperature can overflow to inf, and softmax of inf is NaN:
        # shifted to a largest logit of 0 first, the others only fall towards -inf, so the
        # draw tends to the greedy one as the temperature does (ties drawn evenly). Below
        # the smallest normal float the temperature would round to 0 (0 / 0 is NaN).
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        scaled = shifted / max(temperature, torch.finfo(logits.dtype).tiny)
    else:
        scaled = logits / temperature
    if top_k:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1])).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    # Gumbel-max: argmax(log p - log E), E ~ Exp(1), samples from p with no host sync.
    noise = torch.empty_like(scaled).exponential_()
    return (scaled.log_softmax(-1) - noise.log()).argmax(dim=-1, keepdim=True)


# Below this temperature the fp32 logits are shifted before they are divided; above it they
# are divided as they are, as they always were, so a seed draws the same text as before
# (fp32 holds 3.4e38: logits up to 3e30 in size divide by it without overflow).
_SMALLEST_SAFE = 1e-8
