"""A request's options checked before it reaches a batch: bad input fails here, with an `InputError` that
says what is wrong, never inside a decoding step that other rows share.

    checked = check_request(64, 0.7, 0.95, 0, 42, None, ["\n\n"], True, domain="sql",
                            penalties=(0.5, 0.0, 1.0, {17: -100.0}), logprobs=None, vocab_size=49152)
    checked.params        # SamplingParams(temperature=0.7, top_p=0.95, top_k=0, seed=42)
    checked.penalties     # Penalties(frequency=0.5, presence=0.0, repetition=1.0, bias=((17, -100.0),))
    check_n(3); copies(request, n=3, device=torch.device("cpu"))   # OpenAI's `n`: choice i draws from seed + i

`Engine.request` (engine.py) adds what needs the engine: the prompt encoded with its tokenizer, the
grammar of a `response_format`, its default k and whether it has a draft at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from adaptive_spec.decoding.request import Request
from adaptive_spec.outputs.constraints import Penalties
from adaptive_spec.outputs.tokens import InputError
from adaptive_spec.sample.sampling import SamplingParams

SEEDED_K = 3  # the fixed k of a sampled request with a seed when k is dynamic (see Engine.request)
MAX_LOGPROBS = 20  # the most alternatives a request may ask for per token (OpenAI's limit)
MAX_N = 8  # the most choices one request may ask for


@dataclass(frozen=True)
class Checked:
    """A request's options once checked: what `Request` takes of them."""

    params: SamplingParams
    stops: tuple[str, ...]
    speculative: bool  # as asked, and k != 0
    penalties: Penalties


def check_request(
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    k,
    stop,
    speculative,
    *,
    domain,
    penalties: tuple,
    logprobs,
    vocab_size: int,
) -> Checked:
    """Every option checked; `penalties`: (frequency, presence, repetition, logit_bias) as the API takes them."""
    if domain is not None and (not isinstance(domain, str) or not domain):
        raise InputError(f"domain must be a non-empty string or None, got {domain!r}")
    if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise InputError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
    frequency, presence, repetition, logit_bias = penalties
    bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
    checked_penalties = Penalties(float(frequency), float(presence), float(repetition), bias)
    try:
        checked_penalties.validate(vocab_size)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if k is not None and (not isinstance(k, int) or k < 0):
        raise InputError(f"k must be a non-negative integer or None (dynamic), got {k!r}")
    params = SamplingParams(float(temperature), float(top_p), int(top_k), seed)
    try:
        params.validate()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise InputError("stop must be a non-empty string or a list of them")
    return Checked(params, stops, bool(speculative) and k != 0, checked_penalties)


def new_generator(params: SamplingParams, device: torch.device, offset: int = 0) -> torch.Generator | None:
    """A sampled request's random generator, from its seed (+ `offset`) or a random one; None when greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    seed = params.seed + offset if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    generator.manual_seed(seed)
    return generator


def check_n(n) -> None:
    """OpenAI's `n`, checked before anything else of the request (its prompt is not encoded for a bad n)."""
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InputError(f"n must be an integer in [1, {MAX_N}], got {n!r}")


def copies(first: Request, n: int, device: torch.device) -> list[Request]:
    """`n` requests for one prompt (OpenAI's `n`, `check_n`ed): `first` and copies, each with its own random
    generator. With a seed s, choice i draws from seed s + i, so choice 0 is the single request with that seed
    and the n choices repeat."""
    return [first] + [
        dataclasses.replace(first, generator=new_generator(first.params, device, i) if first.generator else None)
        for i in range(1, n)
    ]
