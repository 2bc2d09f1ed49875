"""The engine: lossless speculative decoding for one request or a batch of them.

    from adaptive_spec import Engine
    engine = Engine.from_pretrained("smollm2-135m-instruct", draft="head")
    out = engine.generate([{"role": "user", "content": "Name three rivers."}], max_new_tokens=64)
    print(out.text, out.stats.mean_acceptance_length)
    outs = engine.generate_batch(["Name a river.", "Name a lake."], max_new_tokens=32)   # decoded together

The engine holds the models, the drafter, the dynamic-k policy and the served adapter. Decoding
happens in a `Batch` (batch.py): `generate` and `stream` decode one request in a batch of one,
`generate_batch` decodes many with continuous batching, and a server keeps one long-lived batch
that requests join and leave between steps (`new_batch`). Each step is draft -> verify ->
accept -> commit over every row. `speculative=False` runs a row with k = 0, which is plain
decoding by the target alone: the baseline every speed figure divides by.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from adaptive_spec.cache import feeding
from adaptive_spec.cache.prefix import PrefixCache
from adaptive_spec.contracts import DEFAULT_DRAFT, DEFAULT_MODEL
from adaptive_spec.decoding.batch import Batch
from adaptive_spec.decoding.dynamic_k import DynamicK
from adaptive_spec.decoding.request import Chunk, GenerationOutput, Request
from adaptive_spec.decoding.requests import SEEDED_K, check_n, check_request, copies, new_generator
from adaptive_spec.drafters import Drafter
from adaptive_spec.drafters.build import loaded_drafter, make_drafter, vocab_size
from adaptive_spec.drafters.slots import AdapterSlot, AdapterSlots, build_slot
from adaptive_spec.drafters.spec import parse_draft_spec
from adaptive_spec.kernels import attention, compiled, cpu_linear, exact
from adaptive_spec.models import load_model, resolve_device, serving_dtype
from adaptive_spec.options import CoreSettings
from adaptive_spec.outputs.grammar import WHITESPACE, GrammarError, Grammars
from adaptive_spec.outputs.tokens import InputError, encode_prompt, eos_ids, tokens_until_stop

log = logging.getLogger(__name__)


class Engine:
    """Speculative decoding over a target model and a draft.

    `draft` is a draft spec (`head`, the default; `early-exit:N`, `ngram`, `ngram:N`, `ngram+<draft>`),
    a model sharing the target's vocabulary, a `Drafter`, the target itself, or None for plain
    decoding only. With `k=None` (the default) k is chosen per step by `DynamicK`; an integer fixes it.

    Its public methods are many because it is the one object a user holds: the Python API (generate,
    stream, generate_batch), what a server builds requests and batches with, the adapter swaps, what a
    `Batch` asks of it (finish, clock) and what the benchmarks report (path, dtype_name, exactness).
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
        max_adapters: int = 8,
        compile: bool = False,
        compile_dir: Path | str | None = None,
        json_whitespace: str = "compact",
        tree_budget: int | None = None,
        prefix_cache_mb: int | None = None,
    ):
        self.target = target.eval().requires_grad_(False)
        self.device = next(target.parameters()).device
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size(target)
        self.dtype = next(target.parameters()).dtype
        self.reduced_precision = self.dtype in (torch.bfloat16, torch.float16)
        # Reduced precision needs batch-invariant kernels to stay lossless (exact.py), and a compiled
        # step is built on them; eager fp32 keeps the fastest kernels per shape, whose rounding
        # differences (~1e-6) almost never swap two logits.
        invariant = self.reduced_precision or compile
        if invariant:
            exact.install(self.target)  # before a draft copies any of its layers
        self.drafter = make_drafter(draft, target, self.vocab_size, self.device)
        drafts = self.drafter.models() if self.drafter is not None else []
        for model in drafts if invariant else [self.target, *drafts]:
            if self.reduced_precision:
                exact.install(model)
            else:
                cpu_linear.install(model)  # fp32 on the CPU only: the faster product order per row count, timed once
                attention.use(model)  # a padded batch's masked attention without copying K/V per query head
        if compile:
            compiled.install(self.target, compile_dir)
            for model in drafts:
                compiled.use_kernel(model)
        self._exactness: exact.InvarianceReport | None = None
        if invariant:  # measured now (and compiled on the way): never claim exactness it does not have
            self._exactness = exact.make_exact(self.target)
        if compile and self.drafter is not None:
            self.drafter.compile()  # its draft steps (a head's); the target's check above may change its kernels
        # Prompts' cached prefixes, where a prefill split anywhere was measured to give the same bits
        # (prefix_cache.py); eager fp32 keeps per-shape kernels, so it computes every prompt whole.
        megabytes = CoreSettings.from_env().prefix_cache_mb if prefix_cache_mb is None else prefix_cache_mb
        reusable = self._exactness is not None and self._exactness.exact and self._exactness.prefix_reuse
        self.prefix_cache = (
            PrefixCache(megabytes << 20, keep_states=self.drafter is not None and self.drafter.wants_target_hidden)
            if megabytes > 0 and reusable
            else None
        )
        self.k = k
        trees = tree_budget if self.drafter is not None and self.drafter.builds_trees else None
        self.policy = DynamicK(
            k_max=k_max, prior_draft_cost=self.drafter.prior_cost if self.drafter else 0.3, tree_budget=trees
        )
        self.target_id = target_id
        self.draft_id = draft_id or (
            draft if isinstance(draft, str) else self.drafter.name if self.drafter else "model"
        )
        self.record_topk = record_topk
        self.adapters = AdapterSlots(max_adapters)  # the general adapter and one per domain (adapter_slots.py)
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        self.eos_ids = eos_ids(target, tokenizer, eos_token_id)
        self._grammars: Grammars | None = None  # built on the first structured request (grammar.py)
        if json_whitespace not in WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {', '.join(WHITESPACE)}, not {json_whitespace!r}")
        self.json_whitespace = json_whitespace  # structured outputs' whitespace policy (grammar.WHITESPACE)
        self._home_thread = threading.get_ident()  # the thread that loaded the models
        self.step_lock = threading.Lock()  # held for each decoding step; adapter swaps take it between steps
        self._batches: weakref.WeakSet[Batch] = weakref.WeakSet()  # open batches, told when the draft changes

    @classmethod
    def from_pretrained(
        cls,
        target: str = DEFAULT_MODEL,
        draft: str | None = DEFAULT_DRAFT,
        device: str = "auto",
        dtype: str = "auto",
        compile: bool | None = None,
        **kwargs,
    ) -> Engine:
        """Load by name: the built-in default, a Hugging Face id or local directory, or a .gguf file.

        The fast path is the default: `dtype="auto"` serves bf16 where the device computes it natively
        and the exactness check passes (fp32 otherwise), and `compile=None` compiles the decoding step
        unless ADAPTIVE_SPEC_COMPILE=0 (compiled code is cached under the data directory's `compile/`)."""
        env = CoreSettings.from_env()
        if compile is None:
            compile = env.compile
        if compile:
            kwargs.setdefault("compile_dir", env.data_dir / "compile")
        dev = resolve_device(device)
        dt = serving_dtype(dtype, dev)
        model, tokenizer = load_model(target, dev, dt)
        drafter: str | Drafter | None = draft
        if isinstance(draft, str) and parse_draft_spec(draft).kind == "model":
            spec = parse_draft_spec(draft)
            drafter = loaded_drafter(spec, load_model(spec.source, dev, dt)[0], vocab_size(model))
        engine = cls(
            model,
            drafter,
            tokenizer,
            target_id=target,
            draft_id=draft if isinstance(draft, str) else None,
            compile=compile,
            **kwargs,
        )
        if dtype == "auto" and dev.type == "cpu" and engine.reduced_precision and not engine.exactness.exact:
            log.warning("serving fp32: %s", engine.exactness.summary())
            return cls.from_pretrained(target, draft, device, "fp32", compile, **kwargs)
        return engine

    @property
    def path(self) -> str:
        """How the target's decoding steps run: "compiled" (compiled.py) or "eager"."""
        return "compiled" if self.target in feeding.COMPILED else "eager"

    @property
    def dtype_name(self) -> str:
        """ "bf16", "fp32" or "fp16": what the target computes in."""
        return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(self.dtype, str(self.dtype))

    @property
    def exactness_known(self) -> bool:
        """Whether `exactness` was measured already (reduced precision and compiled steps measure it at start)."""
        return self._exactness is not None

    @property
    def exactness(self) -> exact.InvarianceReport:
        """Whether a position's logits are bitwise the same whatever shares its forward, as measured
        on this machine (exact.check): measured at start in reduced precision, on first use in fp32."""
        if self._exactness is None:
            with self.step_lock:
                self._exactness = exact.check(self.target)
        return self._exactness

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
        **options,
    ) -> GenerationOutput:
        """Generate for one prompt: token ids, a string, or chat messages. See `stream` for the rest; read
        whole, the request drafts from its first step (`request`'s `streamed`)."""
        options = {"streamed": False, **options}
        request = self.request(prompt, max_new_tokens, temperature, top_p, top_k, seed, k, stop, speculative, **options)
        for chunk in self._stream(request):
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
        **options,
    ) -> Iterator[Chunk]:
        """Yield the tokens of each decoding step as it finishes; the last chunk holds the output.

        Input is checked here, before the first chunk is asked for: a bad request raises
        `InputError` from this call. The request decodes in a batch of its own; several streams
        may run at once from different threads, one step at a time each. Keyword-only options:
        `domain` (the request drafts with that domain's adapter when the engine holds one).
        """
        request = self.request(prompt, max_new_tokens, temperature, top_p, top_k, seed, k, stop, speculative, **options)
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[Chunk]:
        batch = self.new_batch(1)
        batch.add(request)
        while len(batch):
            for _, chunk in batch.step():
                yield chunk

    def generate_batch(
        self, prompts: list, max_new_tokens: int = 64, max_batch: int = 8, **kwargs
    ) -> list[GenerationOutput]:
        """Generate for many prompts with continuous batching: up to `max_batch` decode together,
        and the next prompt joins as soon as a row finishes. Keyword arguments as for `generate`,
        the same for every prompt. Outputs come back in the order of the prompts."""
        kwargs = {"streamed": False, **kwargs}
        requests = deque(enumerate(self.request(p, max_new_tokens, **kwargs) for p in prompts))
        outputs: list[GenerationOutput | None] = [None] * len(prompts)
        batch, index = self.new_batch(max_batch), {}
        while requests or len(batch):
            arriving = [requests.popleft() for _ in range(min(len(requests), batch.max_rows - len(batch)))]
            if arriving:  # prefilled together where their prompts allow (Batch.add_many)
                for (i, _), row in zip(arriving, batch.add_many([r for _, r in arriving]), strict=True):
                    index[row] = i
            for row, chunk in batch.step():
                if chunk.output is not None:
                    outputs[index.pop(row)] = chunk.output
        done = [output for output in outputs if output is not None]
        assert len(done) == len(outputs), "the batch ran until every request finished"
        return done

    def new_batch(self, max_rows: int) -> Batch:
        """An empty batch of up to `max_rows` rows over this engine's models (see batch.py)."""
        batch = Batch(self, max_rows)
        self._batches.add(batch)
        return batch

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids for a prompt given as ids, a string, or chat messages (InputError if it cannot be)."""
        return encode_prompt(prompt, self.tokenizer, self.vocab_size, self.max_context)

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---------------------------------------------------------------- adapters

    @property
    def adapter_version(self) -> str | None:
        """The general adapter's version; None = the base draft."""
        return None if self.adapters.general is None else self.adapters.general.version

    def load_adapter(self, path, version: str | None = None, domain: str | None = None) -> float:
        """Serve an adapter on the draft from now on, for one domain's requests or (domain None)
        for every request whose domain has none; returns how long decoding was held (s).

        The adapter is checked and merged into a new slot while requests keep decoding; only the
        swap itself waits for the current step to end. A bad adapter raises `AdapterError` and
        the served one stays. See `adapters.py` and `adapter_slots.py`.
        """
        drafter = self._adaptable_drafter()
        off_home_thread = threading.get_ident() != self._home_thread  # a watcher's, a trainer's
        slot = build_slot(drafter, path, version, domain, self.vocab_size, one_thread=off_home_thread)
        return self._swap(domain, slot)

    def unload_adapter(self, domain: str | None = None) -> float:
        """Stop serving the adapter of `domain` (None: the general one, so the base draft)."""
        self._adaptable_drafter()
        return self._swap(domain, None)

    def _adaptable_drafter(self):
        if self.drafter is None or not self.drafter.takes_adapters:
            from adaptive_spec.formats.adapters import AdapterError

            raise AdapterError("adapters need a model draft (early-exit:N, head or a separate model)")
        return self.drafter

    def _swap(self, domain: str | None, slot: AdapterSlot | None) -> float:
        with self.step_lock:
            held = time.perf_counter()
            if slot is None:
                self.adapters.remove(domain)
            else:
                self.adapters.put(slot)
            self.policy.new_draft(slot.gated_alpha if slot is not None and domain is None else None)
            for batch in list(self._batches):
                batch.adapters_changed()
            return time.perf_counter() - held

    # ---------------------------------------------------------------- what a batch asks of the engine

    def finish(self, req: Request, out: list[int], context: int) -> tuple[str | None, int]:
        """Whether the output is complete, and how many of its tokens to keep."""
        for i, token in enumerate(out):
            if token in self.eos_ids:
                return "stop", i + 1
        if req.stop and self.tokenizer is not None:
            text = self.decode(out) or ""
            if any(s in text for s in req.stop):
                return "stop", tokens_until_stop(self.decode, out, req.stop)
        if len(out) >= req.max_new_tokens:
            return "length", req.max_new_tokens
        if self.max_context is not None and context >= self.max_context:
            return "length", len(out)
        return None, len(out)

    def clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ---------------------------------------------------------------- input handling

    def request(
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
        *,
        domain: str | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        response_format: dict | None = None,
        logprobs: int | None = None,
        streamed: bool = True,
    ) -> Request:
        """A checked request, ready to join a batch; raises `InputError` for bad input.

        Keyword-only: `domain` (draft with that domain's adapter), the penalties and `logit_bias`
        (constraints.py, OpenAI's formulas; `repetition_penalty` as in transformers), a
        `response_format` (OpenAI's `json_object` or `json_schema`, enforced by a grammar:
        grammar.py), `logprobs` (None: none; n in 0..20: each output token's log-probability
        and the n most likely alternatives, the target's own), and `streamed`: whether the caller reads
        the tokens as they come. At dynamic k a streamed request's first step is the target's alone, so
        its first token comes as soon as the target alone would give it; one that is read whole (as
        `generate` reads it) drafts from its first step. On a trained python head (AMD EPYC, 24 prompts x
        64 tokens, in turns): 151.5 / 157.8 tok/s read whole against 150.0 / 153.2 streamed, 3.08-3.12
        tokens a target forward against 2.83-2.94; the first token after 44 ms against 37."""
        penalties = (frequency_penalty, presence_penalty, repetition_penalty, logit_bias)
        checked = check_request(
            max_new_tokens, temperature, top_p, top_k, seed, k, stop, speculative,
            domain=domain, penalties=penalties, logprobs=logprobs, vocab_size=self.vocab_size,
        )  # fmt: skip
        speculative = checked.speculative and self.drafter is not None
        k = k if k is not None else self.k
        if k is None and checked.params.seed is not None and not checked.params.greedy:
            # Dynamic k follows measured timings, and a different k consumes the random stream
            # differently: a seeded sample would not repeat. A fixed k makes it repeat (for the
            # same draft and adapter version); the distribution is the target's either way.
            k = SEEDED_K
        grammar = self._grammar(response_format)
        return Request(
            self.encode_prompt(prompt),
            max_new_tokens,
            checked.params,
            k,
            checked.stops,
            speculative,
            new_generator(checked.params, self.device),
            domain,
            checked.penalties,
            grammar,
            logprobs,
            streamed=bool(streamed),
        )

    def requests(self, prompt, n: int, *args, **kwargs) -> list[Request]:
        """`n` requests for one prompt (OpenAI's `n`): the same options, each with its own random
        generator. With a seed s, choice i draws from seed s + i, so choice 0 is the single
        request with that seed and the n choices repeat."""
        check_n(n)
        return copies(self.request(prompt, *args, **kwargs), n, self.device)

    def _grammar(self, response_format):
        """The compiled grammar of a response_format (None for free text); InputError if it cannot be."""
        if response_format is None or (isinstance(response_format, dict) and response_format.get("type") == "text"):
            return None
        if self.tokenizer is None:
            raise InputError("response_format needs a tokenizer; this engine has none")
        try:
            if self._grammars is None:
                self._grammars = Grammars(
                    self.tokenizer, self.vocab_size, self.eos_ids, whitespace=self.json_whitespace
                )
            return self._grammars.compile(response_format)
        except GrammarError as exc:
            raise InputError(str(exc)) from None
