"""Batch-invariant forwards: a position's logits are bitwise the same whatever shares the forward.

Speculative decoding is lossless only if the target scores a position the same way in a verify
of k + 1 tokens, in a batch of 8 rows, or alone. Mathematically it does; in floating point a
kernel may add the same numbers in another order when the shape changes, and the rounding then
differs. In fp32 such a difference moves a logit by about 1e-6 and almost never swaps the two best
tokens. In bf16 it moves a logit by up to 0.4 (measured on the default model) and greedy output
flipped at near-ties in 4 of 6 prompts. Probed on an AMD EPYC with AVX512-BF16 (2 cores), the
sources were:

- attention: SDPA's CPU kernel splits the keys into blocks whose size follows the key length
  (`min(kv_len, 512)`), and the query length picks its blocking; a verify and a batch of rows of
  other lengths change both;
- bf16 `F.linear` with a single row takes another kernel than with 2 to 700 rows (the
  1536 -> 576 down projection differs in about 1 row in 10). The LM head on an Intel Xeon with
  AMX switched kernels between 17 and 40 rows.

What is invariant as it stands: RMSNorm, the rotary embedding, the elementwise ops, bf16
`F.linear` for 2 to 700 rows on that CPU, and fp32 `torch.bmm` for any batch, key length and
4 or more query rows when its reduction is 64 or 128 long. This module builds on that:

- `attention`: scores `q @ k.T` in fp32 with at least `MIN_QUERY_ROWS` query rows, then softmax
  and `probs @ [v | 1]` over the keys in fixed blocks of `BLOCK` keys anchored at position 0,
  added in order. Masked keys have probability exactly 0, so keys past a row's own length (other
  rows' longer contexts, padding) add exact zeros, and an extra block adds nothing. The ones
  column gives the softmax's normaliser from the same products.
- `linear`: a lone row is padded to two; with `row_chunk` set, larger inputs run in chunks of
  exactly that many rows (the last one padded), for CPUs whose kernel changes with the row count.
  Inside a compiled step, bf16 products go to linear_bf16.py's kernel instead (COMPILED_LINEAR),
  whose rows are invariant by construction.

The arithmetic is the same as SDPA's (bf16 inputs, fp32 accumulation), so outputs match the stock
path to rounding. Whether it is enough on a given machine is measured, not assumed: `check`
compares the logits of one context computed as a plain step, inside verifies of 2 to 17 tokens,
and in staggered batches of up to 8 rows with padding, bitwise. The engine runs it before it
claims exactness (`Engine.exactness`).

Cost, default model, bf16, 2 cores, 128 cached tokens: a plain step 22.5 -> 27.5 ms eager (most of
it the blocked attention's extra operators, which compiling fuses).

    from adaptive_spec.kernels import exact
    exact.install(model)                      # attention and linears of a reduced-precision model
    report = exact.check(model)               # InvarianceReport(exact=True, compared=49, differing=0, ...)
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from adaptive_spec.cache import feeding, kv

# A transformers causal LM: its parts are reached by name (config, model.layers, set_attn_implementation),
# which nn.Module's types cannot say.
CausalLM = Any

log = logging.getLogger(__name__)

NAME = "adaptive_spec_exact"
BLOCK = 128  # keys per block of the probability-value product (fp32 bmm is invariant at this length)
MIN_QUERY_ROWS = 4  # fp32 bmm takes another kernel below 4 rows
LINEAR_MIN_ROWS = 2  # bf16 F.linear takes another kernel for one row
# The product a compiled step's bf16 linears use instead of F.linear (compiled.install sets it when the C++
# kernel of linear_bf16.py builds): row-invariant for any row count, so no padding or chunking is needed.
COMPILED_LINEAR: list = [None]


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """query [n, heads, q, d], key/value [n, kv_heads, kv_len, d], mask [n, 1, q, kv_len] (True =
    attend) -> ([n, q, heads, d], None), as transformers' attention functions return.

    Example, default model, one row verifying 5 tokens over 130 cached positions: 9 query heads
    share 3 KV heads, so each KV head sees 3 x 5 = 15 query rows; the keys are padded to 256
    (2 blocks); the output is `(P[:, :, 0:128] @ V1[0:128] + P[:, :, 128:256] @ V1[128:256])`,
    whose last column is the normaliser. Without a boolean mask (training, Hugging Face's own
    generate) it hands over to transformers' SDPA.
    """
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs
        )
    n, heads, q, d = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = groups * q  # query rows per KV head: heads are kv-head-major (h = kv_head * groups + g)
    padded_rows = max(rows, MIN_QUERY_ROWS)
    padded_len = -(-kv_len // BLOCK) * BLOCK
    batch = n * kv_heads
    scale = scaling if scaling is not None else d**-0.5

    queries = query.new_zeros((batch, padded_rows, d), dtype=torch.float32)
    queries[:, :rows] = query.reshape(batch, rows, d)
    keys = key.new_zeros((batch, padded_len, d), dtype=torch.float32)
    keys[:, :kv_len] = key.reshape(batch, kv_len, d)
    values = value.new_zeros((batch, padded_len, d + 1), dtype=torch.float32)  # [v | 1]
    values[:, :kv_len, :d] = value.reshape(batch, kv_len, d)
    values[:, :, d] = 1.0

    scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(scale)  # [batch, padded_rows, padded_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = attention_mask[:, :, None].expand(n, 1, groups, q, kv_len).reshape(n, 1, rows, kv_len)
    allowed = mask.new_zeros((n, kv_heads, padded_rows, padded_len))
    allowed[:, :, :rows, :kv_len] = mask
    allowed[:, :, rows:, 0] = True  # padding rows attend to something, so their softmax is finite
    scores.masked_fill_(~allowed.reshape(batch, padded_rows, padded_len), float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))

    out = None
    for start in range(0, padded_len, BLOCK):
        part = torch.bmm(probs[:, :, start : start + BLOCK], values[:, start : start + BLOCK])
        out = part if out is None else out.add_(part)
    out = out[:, :rows, :d] / out[:, :rows, d:]  # [batch, rows, d]
    out = out.reshape(n, kv_heads, groups, q, d).reshape(n, heads, q, d).transpose(1, 2).contiguous()
    return out.to(query.dtype), None


AttentionInterface.register(NAME, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


DRAFT_KERNEL_MAX_ROWS = 64  # a draft's eager products take the kernel up to this many rows (it is for few rows)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_chunk: int | None = None,
    draft: bool = False,
):
    """`F.linear` whose rows do not depend on how many share the product: a lone row is computed
    beside a zero row, and with `row_chunk` every product has exactly `row_chunk` rows. `draft`: a
    draft's own module (`draft_products`), whose few-row products may take the kernel eagerly too."""
    if torch.is_grad_enabled():  # training: the stock kernel, whatever it does with shapes
        return F.linear(x, weight, bias)
    fast = kernel_product(x, weight, bias, draft)
    if fast is not None:
        return fast
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if row_chunk is None:
        if n >= LINEAR_MIN_ROWS:
            return F.linear(x, weight, bias)
        padded = torch.cat([rows, rows.new_zeros((LINEAR_MIN_ROWS - n, rows.shape[1]))])
        return F.linear(padded, weight, bias)[:n].reshape(*x.shape[:-1], weight.shape[0])
    total = -(-n // row_chunk) * row_chunk
    padded = rows if total == n else torch.cat([rows, rows.new_zeros((total - n, rows.shape[1]))])
    out = torch.cat([F.linear(chunk, weight, bias) for chunk in padded.split(row_chunk)])
    return out[:n].reshape(*x.shape[:-1], weight.shape[0])


def kernel_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, draft: bool = False
) -> torch.Tensor | None:
    """`x @ weight.T + bias` through COMPILED_LINEAR where a product takes it: bf16, inside a compiled step, or
    eagerly for a draft's few rows (`draft`, at most DRAFT_KERNEL_MAX_ROWS); None where it does not (off the
    CPU, or under gradients, which the kernel does not give)."""
    kernel = COMPILED_LINEAR[0]
    if kernel is None or torch.is_grad_enabled() or not x.dtype == weight.dtype == torch.bfloat16:
        return None
    if weight.device.type != "cpu":
        return None
    rows = x.reshape(-1, x.shape[-1])
    if not (torch.compiler.is_compiling() or (draft and rows.shape[0] <= DRAFT_KERNEL_MAX_ROWS)):
        return None
    return kernel(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: Any, x: torch.Tensor) -> torch.Tensor:  # an nn.Linear that install() marked
    if getattr(self, "_draft_products", False):
        return linear(x, self.weight, self.bias, self._exact_row_chunk, draft=True)
    return linear(x, self.weight, self.bias, self._exact_row_chunk)


def draft_products(module: nn.Module) -> None:
    """Let the linears of a draft's own module (not the target's, which it may share) take the kernel of
    a compiled step's products (COMPILED_LINEAR) in eager forwards of up to DRAFT_KERNEL_MAX_ROWS rows:
    a draft need not be invariant, since the target verifies every token, only fast. Copies carry it."""
    for linear_module in module.modules():
        if type(linear_module) is nn.Linear:
            linear_module._draft_products = True  # type: ignore[assignment]  # read by _forward


def install(model: CausalLM, row_chunk: int | None = None) -> None:
    """Run `model`'s masked attention through `attention` and its linears through `linear`.
    Idempotent; `row_chunk` may be changed by installing again. Bound per module instance, so a
    deep copy of a layer (early-exit drafts, the head) carries it."""
    stock = ("sdpa", "eager", "adaptive_spec_sdpa", NAME)
    if getattr(model.config, "_attn_implementation", None) in stock and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)  # a draft head shares its target's config, set there
    for module in model.modules():
        if type(module) is nn.Linear:
            module._exact_row_chunk = row_chunk  # type: ignore[assignment]  # read by _forward
            module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]  # per instance, on purpose


def installed(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


@dataclass
class InvarianceReport:
    """What `check` compared: `exact` only when every position's logits were bitwise equal."""

    exact: bool
    compared: int  # positions compared against the same position computed alone
    differing: int
    max_abs_diff: float  # largest logit difference seen (0.0 when exact)
    dtype: str
    row_chunk: int | None = None  # the linear row chunk that made it exact (None: none needed)
    cases: list[str] = field(default_factory=list)  # the shapes that differed, e.g. "verify 5: position 0"
    # whether a prompt prefilled in two parts (a cached prefix, then the rest) gives the same bits as fed
    # whole: what the prefix cache (prefix_cache.py) needs besides `exact`
    prefix_reuse: bool = False

    def summary(self) -> str:
        if self.exact:
            reuse = "" if self.prefix_reuse else "; a prefill split in two differs, so no prefix cache"
            return f"{self.dtype}: batch-invariant ({self.compared} positions bitwise equal across shapes{reuse})"
        return (
            f"{self.dtype}: NOT batch-invariant on this machine: {self.differing} of {self.compared} positions "
            f"differ (max logit difference {self.max_abs_diff:.3g}; first: {', '.join(self.cases[:3])})"
        )


@torch.inference_mode()
def check(model: CausalLM, seed: int = 0, max_rows: int = 8, max_width: int = 17) -> InvarianceReport:
    """Compare, bitwise, the logits of positions computed as a plain step against the same
    positions inside verifies of 2 to `max_width` tokens and inside batches of up to `max_rows`
    rows of other lengths with staggered widths (padding). Random token ids, fixed seed; about
    40 forwards (1.2 s on the default model in bf16 on 2 cores). Apart from those, `prefix_reuse`: a
    prompt prefilled in two parts against the same prompt fed whole (prefix_cache.py)."""

    config = model.config
    vocab = config.vocab_size
    limit = getattr(config, "max_position_embeddings", None) or 4096
    generator = torch.Generator().manual_seed(seed)
    lengths = [min(n, limit - max_width - 1) for n in (40, 77, 120, 13, 200, 64, 90, 150)][:max_rows]
    contexts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    following = torch.randint(0, vocab, (max_width,), generator=generator).tolist()

    def forward(rows: list[list[int]], feeds: list[list[int]]) -> torch.Tensor:
        cache = kv.BatchCache.for_model(model)
        cache.row_capacity = len(rows)
        for context in rows:
            feeding.feed(model, cache, [cache.add_row()], [context])
        return feeding.feed(model, cache, list(range(len(rows))), feeds, all_logits=True)  # [n, width, vocab]

    # each context's next position computed alone, and the positions after it, one step at a time
    alone = [forward([context], [following[:1]])[0, -1] for context in contexts]
    cache = kv.BatchCache.for_model(model)
    feeding.feed(model, cache, [cache.add_row()], [contexts[0]])
    steps = [feeding.feed(model, cache, [0], [[token]], all_logits=True)[0, -1] for token in following]

    comparisons: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for width in sorted({2, 5, 9, max_width} & set(range(2, max_width + 1))):
        out = forward([contexts[0]], [following[:width]])[0]
        comparisons += [(f"verify {width}: position {j}", out[j], steps[j]) for j in range(width)]
    for rows in sorted({2, 4, max_rows} & set(range(2, max_rows + 1))):
        for width in (1, 5):
            out = forward(contexts[:rows], [following[:width]] * rows)
            comparisons += [(f"{rows} rows x {width}: row {r}", out[r, -width], alone[r]) for r in range(rows)]
    widths = [(1, 5, 3, 2, 9, 1, 4, 17)[r] for r in range(len(contexts))]
    widths = [min(w, max_width) for w in widths]
    out = forward(contexts, [following[:w] for w in widths])
    comparisons += [(f"staggered widths {widths}: row {r}", out[r, -widths[r]], alone[r]) for r in range(len(contexts))]

    cases = [name for name, a, b in comparisons if not torch.equal(a, b)]
    worst = max(((a.float() - b.float()).abs().max().item() for _, a, b in comparisons), default=0.0)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    report = InvarianceReport(not cases, len(comparisons), len(cases), worst, dtype, cases=cases)
    report.prefix_reuse = _prefix_reuse(model, contexts[-1], following[:2])
    return report


def _prefix_reuse(model: CausalLM, context: list[int], following: list[int]) -> bool:
    """Whether `context` prefilled in two parts, split at a few points, and then `following` give the
    same logits, bitwise, as the context fed whole (the prefix cache's premise). Also a context longer
    than a prefill chunk, as real prompts are: fed whole it runs as forwards of feeding.PREFILL_CHUNK and
    48 tokens, after a cached prefix of 160 tokens as 160 and 400 (a kernel that picks another path
    for some of those row counts would show here). Skipped where the model's context is shorter."""

    def logits(parts: list[list[int]]) -> torch.Tensor:
        cache = kv.BatchCache.for_model(model)
        row = cache.add_row()
        for part in parts:
            feeding.feed(model, cache, [row], [part])
        return feeding.feed(model, cache, [row], [following], all_logits=True)[0]

    def same_split(tokens: list[int], splits) -> bool:
        whole = logits([tokens])
        return all(torch.equal(whole, logits([tokens[:at], tokens[at:]])) for at in splits)

    splits = sorted({1, 16, len(context) // 2, len(context) - 1} & set(range(1, len(context))))
    if not same_split(context, splits):
        return False
    long = feeding.PREFILL_CHUNK + 48
    limit = getattr(model.config, "max_position_embeddings", None)
    if not context or (limit is not None and long + len(following) > limit):
        return True
    return same_split((context * -(-long // len(context)))[:long], [min(160, long - 1)])


def make_exact(model: CausalLM) -> InvarianceReport:
    """Install the invariant attention and linears, then check; if a lone-row pad is not enough
    on this machine, try fixed row chunks of 16 (the size below the kernel switch measured on a
    Xeon's LM head). On a compiled step, a failed check is first repeated with every one-token step
    padded to 2 columns (`step.pad_plain_steps`; by default only a lone row's is, feeding.compiled_width).
    Returns the report of the last attempt; `exact` says whether it holds.

    The report is kept on the model, with what it was measured on (dtype, device, the compiled step,
    the kernels): a second engine over the same target (another draft, `bench --compare-drafts`)
    installs the row chunk measured and skips the check, which takes seconds. Anything else changed
    in between measures again."""
    parameter = next(model.parameters())
    measured_on = (
        str(parameter.dtype),
        str(parameter.device),
        id(feeding.COMPILED.get(model)),
        linear,
        attention,
        COMPILED_LINEAR[0],
        getattr(model.config, "_attn_implementation", None),
    )
    known = getattr(model, "_adaptive_spec_exactness", None)
    if known is not None and known[0] == measured_on:
        install(model, known[1].row_chunk)  # the compiled step, if any, was built for this chunk then
        return replace(known[1], cases=list(known[1].cases))
    report = None
    for row_chunk in (None, 16):
        install(model, row_chunk)
        step = feeding.COMPILED.get(model)
        if step is not None and row_chunk is not None:
            step.rebuild()  # its compiled code does not check the modules install() just changed
        report = check(model)
        if not report.exact and step is not None and not step.pad_plain_steps:
            step.pad_plain_steps = True  # several rows of one token each, padded as a lone row's step is
            report = check(model)
        report.row_chunk = row_chunk
        if report.exact:
            break
    assert report is not None
    (log.info if report.exact else log.warning)("exactness check: %s", report.summary())
    model._adaptive_spec_exactness = (measured_on, replace(report, cases=list(report.cases)))  # a record on the module
    return report
