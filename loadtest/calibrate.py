"""Calibrating the prompt-token counter against the server before a run (see tokens.py)."""

from __future__ import annotations

import httpx

from loadtest import datasets
from loadtest.client import Target, send_request
from loadtest.tokens import ESTIMATE, Encode, TokenCounter, fit_counter, with_tokenizer


def load_encoder(path: str) -> Encode:
    """The checkpoint's tokenizer, encoding user text (special-token strings as plain text)."""
    from ddserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    return lambda text: tok.encode(text, allow_special=False)


async def measure_counter(
    client: httpx.AsyncClient, target: Target, encode: Encode | None, name: str | None
) -> TokenCounter:
    """Probe requests (max_tokens 1) whose usage.prompt_tokens calibrate the token counter."""
    texts = datasets.probe_texts()
    probes = []
    for text in texts[1:2] if encode else texts:
        res = await send_request(client, target, datasets.Prompt(text, 0, 1))
        if not (res.success and res.usage_reported):
            why = res.error or "no usage in the response"
            print(f"loadtest: a probe request gave no usage.prompt_tokens ({why})", flush=True)
            return with_tokenizer(encode, None, str(name)) if encode else ESTIMATE
        probes.append((text, res.prompt_len))
    if encode:
        return with_tokenizer(encode, probes[0], str(name))
    try:
        return fit_counter(probes)
    except ValueError as e:
        print(f"loadtest: {e}", flush=True)
        return ESTIMATE
