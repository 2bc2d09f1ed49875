"""The engine: lossless speculative decoding for one request at a time.

    from adaptive_spec import Engine
    engine = Engine.from_pretrained("smollm2-135m-instruct", draft="early-exit:4")
    out = engine.generate([{"role": "user", "content": "Name three rivers."}], max_new_tokens=64)
    print(out.text, out.stats.mean_acceptance_length)

Each decoding step is draft -> verify -> accept -> commit (`_decode`). The target's KV cache
always holds every context token but the last, the *pending* token, which is the first input
of the next verification. With k drafts the target runs once on [pending, d1..dk] and returns
k + 1 next-token distributions; the step emits the accepted drafts plus one recovered or bonus
token, and both caches are rolled back to the accepted context. `speculative=False` runs the
same loop with k = 0, which is plain decoding: the baseline every speed figure divides by.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adaptive_spec import cpu_linear, kv
from adaptive_spec.acceptance import Verdict, greedy_accept, rejection_sample
from adaptive_spec.drafters import Drafter, Proposal
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.drafters.model import ModelDrafter
from adaptive_spec.drafters.ngram import NgramDrafter
from adaptive_spec.drafters.spec import DraftSpecError, parse_draft_spec
from adaptive_spec.dynamic_k import DynamicK
from adaptive_spec.models import DEFAULT_MODEL, load_model, resolve_device, resolve_dtype
from adaptive_spec.sampling import SamplingParams, logits_to_probs
from adaptive_spec.stats import RequestStats, StepStats

DEFAULT_DRAFT = "early-exit:4"
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class InputError(ValueError):
    """A request the engine refuses, with a message meant for the caller."""


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens only; EOS, or the token completing a stop string, included
    text: str | None  # None without a tokenizer; ends before a stop string, which it does not contain
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: RequestStats
    prompt_ids: list[int]
    proposed: list[int]  # [n_out] the draft token proposed at each output position, or -1
    accepted: list[bool]  # [n_out] whether the output token is an accepted draft token
    target_topk_ids: torch.Tensor | None = None  # [n_out, m] the target's top-m tokens per position
    target_topk_logprobs: torch.Tensor | None = None  # [n_out, m] their log-probabilities


@dataclass
class Chunk:
    """What one decoding step adds while streaming. The last chunk carries the whole output."""

    token_ids: list[int]
    finish_reason: str | None = None
    output: GenerationOutput | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    k: int | None
    stop: tuple[str, ...]
    drafter: Drafter | None
    generator: torch.Generator | None


@dataclass
class _Trace:
    """Per output position: what was proposed, what was kept, and the target's top-m."""

    topk: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # each [emitted, m]
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)

    def record(self, proposal: Proposal, verdict: Verdict, target_logits: torch.Tensor) -> None:
        drafted = proposal.tokens.tolist()
        n = verdict.num_accepted
        self.proposed += drafted[: n + 1] + [-1] * (n + 1 - len(drafted[: n + 1]))
        self.accepted += [True] * n + [False]
        if self.topk:
            logprobs = torch.log_softmax(target_logits[: n + 1].float(), dim=-1)  # [n + 1, vocab]
            top = logprobs.topk(self.topk, dim=-1)
            self.topk_ids.append(top.indices)
            self.topk_logprobs.append(top.values)

    def truncate(self, length: int) -> None:
        del self.proposed[length:], self.accepted[length:]

    def stacked(self, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.topk:
            return None, None
        ids = torch.cat(self.topk_ids)[:length].cpu() if self.topk_ids else torch.zeros(0, self.topk, dtype=torch.long)
        values = torch.cat(self.topk_logprobs)[:length].cpu() if self.topk_logprobs else torch.zeros(0, self.topk)
        return ids, values


SEEDED_K = 3  # the fixed k of a sampled request with a seed when k is dynamic (see Engine._request)


class Engine:
    """Speculative decoding over a target model and a draft.

    `draft` is a draft spec (`early-exit:N`, `ngram`, `ngram:N`), a model sharing the target's
    vocabulary, a `Drafter`, the target itself, or None for plain decoding only. With `k=None`
    (the default) k is chosen per step by `DynamicK`; an integer fixes it.
    """

    def __init__(
        self,
        target,
        draft=DEFAULT_DRAFT,
        tokenizer=None,
        *,
        k: int | None = None,
        k_max: int = 8,
        target_id: str = "target",
        draft_id: str | None = None,
        record_topk: int = 0,
        eos_token_id: int | list[int] | None = None,
    ):
        self.target = target.eval().requires_grad_(False)
        self.device = next(target.parameters()).device
        self.tokenizer = tokenizer
        self.vocab_size = _vocab_size(target)
        self.drafter = _make_drafter(draft, target, self.vocab_size, self.device)
        cpu_linear.install(self.target)  # fp32 on the CPU only (cpu_linear.applies): ~2x faster decoding steps
        if isinstance(self.drafter, ModelDrafter):
            cpu_linear.install(self.drafter.model)
        self.k = k
        self.policy = DynamicK(k_max=k_max, prior_draft_cost=0.0 if isinstance(self.drafter, NgramDrafter) else 0.3)
        self.target_id = target_id
        self.draft_id = draft_id or (draft if isinstance(draft, str) else getattr(self.drafter, "name", "model"))
        self.record_topk = record_topk
        self.adapter_version: str | None = None  # None = the base draft
        self._base_layers = None  # the draft's layers as built, kept to merge adapters onto
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        self.eos_ids = _eos_ids(target, tokenizer, eos_token_id)
        self._request_lock = threading.Lock()  # one request at a time: caches are per engine
        self.step_lock = threading.Lock()  # held for each decoding step; adapter swaps take it between steps

    @classmethod
    def from_pretrained(
        cls,
        target: str = DEFAULT_MODEL,
        draft: str | None = DEFAULT_DRAFT,
        device: str = "auto",
        dtype: str = "auto",
        **kwargs,
    ) -> Engine:
        """Load by name: the built-in default, a Hugging Face id or local directory, or a .gguf file."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        model, tokenizer = load_model(target, dev, dt)
        draft_model = draft
        if isinstance(draft, str) and parse_draft_spec(draft).kind == "model":
            draft_model, _ = load_model(draft, dev, dt)
        return cls(
            model,
            draft_model,
            tokenizer,
            target_id=target,
            draft_id=draft if isinstance(draft, str) else None,
            **kwargs,
        )

    # ---------------------------------------------------------------- public API

    def generate(
        self,
        prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        k: int | None = None,
        stop: str | list[str] | None = None,
        speculative: bool = True,
    ) -> GenerationOutput:
        """Generate for one prompt: token ids, a string, or chat messages. See `stream` for the rest."""
        for chunk in self.stream(prompt, max_new_tokens, temperature, top_p, top_k, seed, k, stop, speculative):
            if chunk.output is not None:
                return chunk.output
        raise AssertionError("decoding ended without an output")  # unreachable: the last chunk has one

    def stream(
        self,
        prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        k: int | None = None,
        stop: str | list[str] | None = None,
        speculative: bool = True,
    ) -> Iterator[Chunk]:
        """Yield the tokens of each decoding step as it finishes; the last chunk holds the output.

        Input is checked here, before the first chunk is asked for: a bad request raises
        `InputError` from this call. The engine decodes one request at a time; a stream that is
        left half read holds it until the stream is closed.
        """
        request = self._request(prompt, max_new_tokens, temperature, top_p, top_k, seed, k, stop, speculative)
        return self._locked(request)

    def _locked(self, request: _Request) -> Iterator[Chunk]:
        with self._request_lock:
            yield from self._decode(request)

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids for a prompt given as ids, a string, or chat messages."""
        if isinstance(prompt, str):
            ids = self._need_tokenizer("a text prompt").encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._chat_ids(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InputError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            return self.encode_prompt(prompt.tolist())
        else:
            raise InputError(
                "prompt must be a list of token ids, a string, or a list of chat messages "
                "({'role': ..., 'content': ...})"
            )
        if not ids:
            raise InputError("the prompt is empty")
        if self.max_context is not None and len(ids) >= self.max_context:
            raise InputError(
                f"the prompt has {len(ids)} tokens, over the model's context of {self.max_context} "
                f"(at least one must remain for the output)"
            )
        return ids

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---------------------------------------------------------------- adapters

    def load_adapter(self, path, version: str | None = None) -> float:
        """Serve a LoRA adapter on the draft from now on; returns how long decoding was held (s).

        The adapter is checked and merged into a new slot while requests keep decoding; only the
        swap itself waits for the current step to end. A bad adapter raises `AdapterError` and
        the served one stays. See `adapters.py`.
        """
        from adaptive_spec import adapters

        drafter = self._adaptable_drafter()
        config, tensors, metadata = adapters.read_adapter(path)
        pairs = adapters.lora_pairs(config, tensors)
        adapters.check(drafter.model, pairs)
        vocab = adapters.read_vocab(path, self.vocab_size)
        slot = adapters.merge_into_slot(self._base_layers, pairs)
        gated = metadata.get("gate", {}).get("candidate", {}).get("greedy_match")
        return self._swap_layers(slot, version or str(metadata.get("version", Path(path).name)), vocab, gated)

    def unload_adapter(self) -> float:
        """Serve the base draft again, over the full vocabulary."""
        self._adaptable_drafter()
        return self._swap_layers(self._base_layers, None, None, None)

    def _adaptable_drafter(self) -> ModelDrafter:
        if not isinstance(self.drafter, ModelDrafter):
            from adaptive_spec.adapters import AdapterError

            raise AdapterError("adapters need a model draft (early-exit:N or a separate model)")
        if self._base_layers is None:
            self._base_layers = self.drafter.model.model.layers
        return self.drafter

    def _swap_layers(self, layers, version: str | None, vocab: list[int] | None, expected_alpha: float | None) -> float:
        with self.step_lock:
            held = time.perf_counter()
            self.drafter.model.model.layers = layers
            self.drafter.restrict_vocab(vocab)
            self.drafter.invalidate()
            self.policy.new_draft(expected_alpha)
            self.adapter_version = version
            return time.perf_counter() - held

    # ---------------------------------------------------------------- the loop

    def _decode(self, req: _Request) -> Iterator[Chunk]:
        started = time.perf_counter()
        ids = list(req.prompt_ids)  # the context; its last token is pending (not yet in the cache)
        stats, trace = RequestStats(adapter_version=self.adapter_version), _Trace(self.record_topk)
        cache = self._prefill(ids, req, stats)
        out: list[int] = []
        finish = None
        while finish is None:
            with self.step_lock:
                proposal, draft_s = self._draft(req, ids, self._choose_k(req, len(out), len(ids)))
                target_logits, verify_s = self._verify(cache, ids[-1], proposal.tokens)
                verdict = self._accept(req, proposal, target_logits)
                emitted = self._commit(req, cache, ids, proposal, verdict)
            trace.record(proposal, verdict, target_logits)
            out += emitted
            finish, keep = self._finish(req, out, len(ids))
            cut = len(out) - keep
            del out[keep:]
            stats.add(
                StepStats(
                    len(proposal.tokens), verdict.num_accepted, len(emitted) - cut, proposal.forwards, draft_s, verify_s
                )
            )
            self.policy.observe(
                len(proposal.tokens),
                verdict.num_accepted,
                draft_s,
                proposal.forwards,
                verify_s,
                catch_up=proposal.fed > 2,
            )
            if finish is None:
                yield Chunk(emitted)
        trace.truncate(len(out))
        stats.wall_s = time.perf_counter() - started
        stats.adapter_version = self.adapter_version  # the version at the end, if a swap came mid-request
        topk_ids, topk_logprobs = trace.stacked(len(out))
        output = GenerationOutput(
            out,
            _cut_at_stop(self.decode(out), req.stop),
            finish,
            stats,
            list(req.prompt_ids),
            trace.proposed,
            trace.accepted,
            topk_ids,
            topk_logprobs,
        )
        yield Chunk(emitted[: len(emitted) - cut], finish, output)

    # ---------------------------------------------------------------- the four verbs and their helpers

    def _choose_k(self, req: _Request, generated: int, context: int) -> int:
        """Draft no more than the budget can use: the step emits k + 1 tokens at most."""
        limit = req.max_new_tokens - generated - 1
        if self.max_context is not None:
            limit = min(limit, self.max_context - context - 1)
        if req.drafter is None or limit <= 0:
            return 0
        if req.k is None and generated == 0:  # time to first token: the first step is the target's alone
            return 0
        return min(req.k, limit) if req.k is not None else self.policy.choose(limit)

    def _draft(self, req: _Request, ids: list[int], k: int) -> tuple[Proposal, float]:
        if k == 0:
            return Proposal(torch.zeros(0, dtype=torch.long, device=self.device), None), 0.0
        started = self._clock()
        proposal = req.drafter.propose(ids, k, req.params, req.generator)
        return proposal, self._clock() - started

    @torch.inference_mode()
    def _verify(self, cache, pending: int, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
        """One target forward on [pending, d1..dk]: logits [k + 1, vocab]."""
        started = self._clock()
        inputs = torch.cat([torch.tensor([pending], device=self.device), draft_tokens])[None]  # [1, k + 1]
        logits = self.target(input_ids=inputs, past_key_values=cache, use_cache=True).logits[0]  # [k + 1, vocab]
        return logits, self._clock() - started

    def _accept(self, req: _Request, proposal: Proposal, target_logits: torch.Tensor) -> Verdict:
        if req.params.greedy:
            return greedy_accept(proposal.tokens, target_logits)
        target_probs = logits_to_probs(target_logits, req.params)  # [k + 1, vocab]
        return rejection_sample(proposal.tokens, proposal.probs, target_probs, req.generator)

    def _commit(self, req: _Request, cache, ids: list[int], proposal: Proposal, verdict: Verdict) -> list[int]:
        """Extend the context and roll both caches back to it; return the emitted tokens."""
        emitted = proposal.tokens[: verdict.num_accepted].tolist() + [verdict.next_token]
        ids += emitted
        kv.rollback(cache, len(ids) - 1)
        if req.drafter is not None:
            req.drafter.rollback(len(ids) - 1)
        return emitted

    @torch.inference_mode()
    def _prefill(self, ids: list[int], req: _Request, stats: RequestStats):
        started = self._clock()
        cache = kv.new_cache(self.target)
        if len(ids) > 1:
            self.target(
                input_ids=torch.tensor([ids[:-1]], device=self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        if req.drafter is not None:
            req.drafter.reset(ids)
        self.policy.start_request()
        stats.prefill_s = self._clock() - started
        return cache

    def _finish(self, req: _Request, out: list[int], context: int) -> tuple[str | None, int]:
        """Whether the output is complete, and how many of its tokens to keep."""
        for i, token in enumerate(out):
            if token in self.eos_ids:
                return "stop", i + 1
        if req.stop and self.tokenizer is not None:
            text = self.decode(out)
            if any(s in text for s in req.stop):
                return "stop", _tokens_until_stop(self, out, req.stop)
        if len(out) >= req.max_new_tokens:
            return "length", req.max_new_tokens
        if self.max_context is not None and context >= self.max_context:
            return "length", len(out)
        return None, len(out)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ---------------------------------------------------------------- input handling

    def _request(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, k, stop, speculative) -> _Request:
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
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        drafter = self.drafter if speculative and k != 0 else None
        k = k if k is not None else self.k
        if k is None and seed is not None and not params.greedy:
            # Dynamic k follows measured timings, and a different k consumes the random stream
            # differently: a seeded sample would not repeat. A fixed k makes it repeat (for the
            # same draft and adapter version); the distribution is the target's either way.
            k = SEEDED_K
        return _Request(self.encode_prompt(prompt), max_new_tokens, params, k, stops, drafter, generator)

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        tokenizer = self._need_tokenizer("chat messages")
        for i, message in enumerate(messages):
            if message.get("role") not in CHAT_ROLES:
                raise InputError(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {message.get('role')!r}"
                )
            if not isinstance(message.get("content"), str):
                raise InputError(f"messages[{i}].content must be a string")
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(encoded, "keys"):  # transformers 5 returns a BatchEncoding
            encoded = encoded["input_ids"]
        return list(encoded)

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise InputError(f"{what} need a tokenizer; this engine has none, so pass token ids")
        return self.tokenizer


def _tokens_until_stop(engine: Engine, out: list[int], stops: tuple[str, ...]) -> int:
    """The shortest prefix of `out` whose text contains a stop string."""
    for n in range(1, len(out) + 1):
        text = engine.decode(out[:n])
        if any(s in text for s in stops):
            return n
    return len(out)


def _cut_at_stop(text: str | None, stops: tuple[str, ...]) -> str | None:
    """The text before the first stop string, which is not part of the output (as in OpenAI's API)."""
    if text is None or not stops:
        return text
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def _vocab_size(model) -> int:
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def _eos_ids(model, tokenizer, override) -> set[int]:
    if override is not None:
        return {override} if isinstance(override, int) else set(override)
    found = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(v for v in value if isinstance(v, int))
    return found


def _make_drafter(draft, target, vocab_size: int, device: torch.device) -> Drafter | None:
    if draft is None:
        return None
    if isinstance(draft, str):
        spec = parse_draft_spec(draft)
        if spec.kind == "ngram":
            return NgramDrafter(spec.max_ngram, device)
        if spec.kind == "early-exit":
            return ModelDrafter(build_early_exit(target, spec.layers), name=draft)
        raise DraftSpecError(
            f"unknown draft spec {draft!r}: use early-exit:N, ngram, ngram:N, or a model "
            f"(Engine.from_pretrained loads a draft model by name)"
        )
    if isinstance(draft, torch.nn.Module):
        draft_vocab = _vocab_size(draft)
        if draft_vocab != vocab_size:
            raise DraftSpecError(
                f"the draft's vocabulary has {draft_vocab} tokens and the target's {vocab_size}; a separate "
                f"draft must share the target's tokenizer and vocabulary (or use early-exit:N or ngram)"
            )
        return ModelDrafter(draft.eval().requires_grad_(False), name=type(draft).__name__)
    if hasattr(draft, "propose"):
        return draft
    raise DraftSpecError(f"draft must be a spec string, a model or a Drafter, got {type(draft).__name__}")
