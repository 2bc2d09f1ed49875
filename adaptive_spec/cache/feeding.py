"""Feeding a batch's rows: one forward of a model over the tokens each row is fed after its cached context.

    logits = feeding.feed(model, cache, rows=[0, 1], feeds=[[5, 17, 33], [8]], all_logits=True)  # [2, 3, vocab]
    with feeding.capture_states(model) as states: ...      # the target's states (`state_layers`) per forward

`feed` is the one forward every part of the loop runs, target and drafts alike: prefills (a long prompt in
chunks of PREFILL_CHUNK), verifies, plain steps and tree feeds. It builds each row's positions and mask from
the padded cache (kv.py), runs the model, and advances each row's length. Where the kernels floor compiled a
model's step (kernels/compiled.py), it registered the step in `COMPILED`, and `feed` runs steps and prefills
through it: this module imports no kernel.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch

from adaptive_spec.cache.kv import BatchCache, TreeFeed

COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its compiled step (compiled.py)

PREFILL_CHUNK = 512  # tokens per forward when one row feeds many (bounds the mask and activations)


def prefill_chunks(tokens: int) -> list[slice]:
    """How a prompt of `tokens` tokens is fed: whole chunks of PREFILL_CHUNK, the remainder last.
    Example: 1,300 tokens -> [0:512], [512:1024], [1024:1300]. Every prefill of a prompt follows
    these boundaries (feed, prefill.py), so its keys and values are the same however it is fed. A
    prefix found in the prefix cache moves them (the rest is cut from its end); the cache is on only
    where exact.check measured that this changes no bit (InvarianceReport.prefix_reuse)."""
    starts = range(0, max(tokens - PREFILL_CHUNK, 0), PREFILL_CHUNK)
    last = tokens - (tokens % PREFILL_CHUNK or PREFILL_CHUNK) if tokens > PREFILL_CHUNK else 0
    return [slice(start, start + PREFILL_CHUNK) for start in starts] + [slice(last, tokens)]


@torch.inference_mode()
def feed(
    model,
    cache: BatchCache,
    rows: list[int],
    feeds: list[list[int]],
    *,
    all_logits: bool = False,
    decoder_only: bool = False,
    hidden: bool = False,
    trees: list[TreeFeed] | None = None,
):
    """Run `model` on `feeds[i]` after row `rows[i]`'s cached context and advance each row's length.

    Returns logits `[n, width, vocab]` when `all_logits` (feeds right-aligned: row i's own tokens
    are the last `len(feeds[i])` columns), else `[n, vocab]` after each row's last token; with
    `decoder_only`, the decoder's last hidden state `[n, hidden]` instead of logits. With
    `hidden`, also the hidden state entering the final norm at every fed position,
    `[n, width, hidden]` (what a head draft reads): `(logits, hidden)`. A single row feeding more
    than PREFILL_CHUNK tokens (a prompt) runs in chunks. With `trees`, each feed is (part of) a
    draft tree (TreeFeed); its tokens still advance the row's length by one each, and the caller
    keeps the accepted path (BatchCache.keep) and sets the length.
    """
    if len(rows) == 1 and len(feeds[0]) > PREFILL_CHUNK and not all_logits:
        tokens, states, *head, last = feeds[0], [], *prefill_chunks(len(feeds[0]))
        for chunk in head:
            out = feed(model, cache, rows, [tokens[chunk]], decoder_only=True, hidden=hidden)
            if hidden:
                states.append(out[1])
        out = feed(model, cache, rows, [tokens[last]], decoder_only=decoder_only, hidden=hidden)
        return (out[0], torch.cat([*states, out[1]], dim=1)) if hidden else out
    fed = [len(f) for f in feeds]
    width = max(fed)
    ids = torch.tensor([[f[0]] * (width - len(f)) + list(f) for f in feeds], device=cache.device)  # [n, width]
    step = COMPILED.get(model)
    if step is not None and all_logits and not decoder_only and rows == list(range(len(rows))):
        return _compiled_feed(step, model, cache, feeds, hidden, trees)
    if step is not None and not all_logits and trees is None:
        return _compiled_prefill(step, model, cache, rows, feeds, decoder_only, hidden)
    positions, mask = cache.inputs(rows, fed, width, trees=trees)
    with capture_states(model, hidden) as captured:
        if decoder_only:
            decoder = decoder_of(model)
            states = decoder(
                input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True
            ).last_hidden_state  # [n, width, hidden]
            out = states[:, -1]
        else:
            logits = model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if all_logits else 1,
            ).logits  # [n, width or 1, vocab]
            out = logits if all_logits else logits[:, -1]
    for row, n in zip(rows, fed, strict=True):
        cache.set_length(row, cache.lengths[row] + n)
    return (out, captured[0]) if hidden else out


def compiled_width(step, fed: list[int]) -> int:
    """Columns of a compiled step that feeds `fed[i]` tokens to row i: the widest feed, but 2 for a lone
    row's single token. Dynamo gives a [1, 1] input a graph of its own, which could fuse its arithmetic
    differently, so a lone row's plain step takes a padding column and runs the graph every other step
    runs. Several rows of one token each run that same graph at width 1: padded to 2 they cost twice the
    products' rows, which on a CPU bound by its bf16 arithmetic was most of a batched plain step (8 rows,
    Intel Xeon without AMX: 42.5 -> 26.5 ms). Where the invariance check finds that this changes a bit,
    `exact.make_exact` sets `step.pad_plain_steps` and every one-token step is padded again."""
    width = max(fed)
    if width == 1 and (len(fed) == 1 or step.pad_plain_steps):
        return 2
    return width


def _compiled_feed(
    step, model, cache: BatchCache, feeds: list[list[int]], hidden: bool, trees=None, last_only: bool = False
):
    """`feed` of rows 0..n-1 through the model's compiled step (compiled.py), `compiled_width` columns wide;
    with `last_only`, logits at the last column only (`[n, 1, vocab]`)."""
    fed = [len(f) for f in feeds]
    width = compiled_width(step, fed)
    ids = torch.tensor([[f[0]] * (width - len(f)) + list(f) for f in feeds], device=cache.device)  # [n, width]
    cache.allocate_for(model)
    positions, mask = cache.inputs(list(range(len(feeds))), fed, width, whole=True, trees=trees)
    columns = torch.tensor([width - 1], device=cache.device) if last_only else None
    logits, states = step(ids, positions, mask, cache, columns)  # [n, width, vocab], [n, width, hidden]
    for row, n in enumerate(fed):
        cache.set_length(row, cache.lengths[row] + n)
    return (logits, states) if hidden else logits


def _compiled_prefill(
    step, model, cache: BatchCache, rows: list[int], feeds: list[list[int]], decoder_only: bool, hidden: bool
):
    """`feed` of prompts (or chunks of them) through the compiled step, with the logits of each row's last
    position only. The step runs rows 0..n-1 of a cache, so rows of a cache that holds others go through a
    cache of their own: their contexts are copied in, the tokens fed, and the rows copied back. Several rows
    share one forward as a step's rows do (Batch.add_many: requests that arrived together).

    Why a prefill runs compiled, where it ran eager: every prefill of a model must take the same path (a
    prompt's positions are computed once, kept in the prefix cache, and reused by requests decoded in either
    mode), and the eager and compiled products differ in their last bits, so it is all prefills or none. The
    prefix cache leaves most prompts a tail of 1-16 tokens, which the eager forward took 41-63 ms for against
    14-31 compiled (default model, bf16, Intel Xeon, 2 cores); a 512-token chunk costs about the same either
    way. That a prefill split anywhere gives the same bits is measured on this path (exact.check's prefix_reuse)."""
    own = rows == list(range(cache.num_rows))
    stage = cache
    if not own:
        stage = BatchCache.for_model(model)
        stage.row_capacity = len(rows)
        for i, row in enumerate(rows):
            stage.add_row()
            stage.copy_from(cache, row, i)
    logits, states = _compiled_feed(step, model, stage, feeds, hidden=True, last_only=True)
    if not own:
        for i, row in enumerate(rows):
            cache.copy_from(stage, i, row)
    last = states[:, -1, -step.hidden_size :]  # the last of the states side by side is what enters the norm
    out = step.norm(last) if decoder_only else logits[:, -1]  # as the eager decoder's output, normed
    return (out, states[:, states.shape[1] - max(len(f) for f in feeds) :]) if hidden else out


def decoder_of(model):
    """A causal LM's decoder (`model.model` in the Llama family): its layers, its final norm."""
    return model.model if hasattr(model, "model") else model.get_decoder()


def state_layers(model) -> tuple[int, ...]:
    """The decoder layers whose outputs make up the target's state at a position, side by side in this order, as
    `feed(..., hidden=True)` returns it and a head draft reads it: EAGLE-3's low, middle and high features (Li et
    al. 2025), the outputs of the second layer, of the one before the middle and of the last (what enters the
    final norm). On the default model's 30 layers (1, 14, 29): a state is 3 x 576 wide. A model whose layers are
    not at `model.model.layers` (no head draft serves it) gives the last alone, `(-1,)`."""
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return (-1,)
    n = len(layers)
    return tuple(sorted({min(1, n - 1), max(n // 2 - 1, 0), n - 1}))


@contextmanager
def capture_states(model, active: bool = True, layers: tuple[int, ...] | None = None):
    """Collect the target's states (`state_layers`, or these `layers`) of each forward during the block, a
    `[n, width, hidden * len(layers)]` tensor per forward, once the block ends. This thread's calls
    only: an early-exit draft shares the final norm and may run in another thread; the head trainer runs the
    serving engine's target in its own. The last layer's output is taken where it enters the final norm."""
    captured: list[torch.Tensor] = []
    if not active:
        yield captured
        return
    decoder = decoder_of(model)
    layers = state_layers(model) if layers is None else layers
    owner = threading.get_ident()

    def output_hook(module, args, output):
        if threading.get_ident() == owner:
            captured.append(output[0] if isinstance(output, tuple) else output)

    def norm_hook(module, args):
        if threading.get_ident() == owner:
            captured.append(args[0])

    handles = [decoder.layers[i].register_forward_hook(output_hook) for i in layers[:-1]]
    handles.append(decoder.norm.register_forward_pre_hook(norm_hook))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
        parts = list(captured)
        captured[:] = [torch.cat(parts[i : i + len(layers)], dim=-1) for i in range(0, len(parts), len(layers))]
