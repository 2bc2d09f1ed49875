"""Compiled decoding steps: the target's verify forward through torch.compile (inductor).

A decoding step of the default model in eager PyTorch dispatches about 1,800 operators (norms,
projections, rotary, the cache write, attention, the MLP, residuals, 30 times over), and on a
2-core CPU the dispatching, not the weights, is most of its cost. Compiled, the pointwise work
of each layer fuses into a few C++ kernels; the matrix products stay the library's, except bf16 ones
on a CPU with AVX512-BF16, which go to the row-invariant kernel of linear_bf16.py (twice as fast
for the few rows of a step).

    from adaptive_spec.kernels import compiled
    compiled.install(model, cache_dir=data_dir / "compile")   # feeding.feed runs its steps compiled from now on

What runs compiled: a step over every row of a batch (`feeding.feed` with rows 0..n-1, as every verify
and plain step is), from the embedding to the logits of every fed position, plus the states that
enter the final norm (what a head draft reads); and every prefill of the target (one row, many
tokens, logits at the last position only), through the same graph (feeding._compiled_prefill). That is
the same for the target alone and for speculation, so outputs still compare token for token. A head
draft's steps run compiled too, in graphs of their own (`draft_forward`, HeadDrafter.compile); the other
drafts' forwards run eager. A draft's numbers only choose what it proposes: the target verifies.

Shapes: one graph serves every number of rows, tokens per row and cache capacity (dynamic
dimensions, without the usual specialisation of size 1, `backed_size_oblivious`): the step attends
over the cache's whole capacity, which grows in multiples of 256 positions, with the mask hiding
what a row may not see. Exactness holds because the graph is the same for every shape and its
attention is a batch-invariant kernel called as an opaque operator that the compiler does not rewrite:
attention_cpu.py's C++ kernel (`adaptive_spec_attention::attention`) on the CPU where it builds, else
exact.py's (`adaptive_spec::attention`); `exact.check` measures it on the compiled path like on the eager one.

Compiled code is cached under `cache_dir` (inductor's FX graph cache and AOT autograd's, beside the
C++ kernels in `extensions/`), so only a server's first start pays for generating code. On the
default model, 2 cores (AMD EPYC Zen 5), `Engine.from_pretrained` with a new cache directory took
137 s (the kernels about 36 s of it), and 52 s with the same directory again: dynamo still traces
the model at every start, only inductor's and AOT autograd's work comes from the cache.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from adaptive_spec.cache import feeding
from adaptive_spec.kernels import attention_cpu, exact, linear_bf16

log = logging.getLogger(__name__)


_KERNEL: list = [None]  # attention_cpu's kernel once install() built it, else exact.attention serves


@torch.library.custom_op("adaptive_spec::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:  # fmt: skip  # torch.library reads the annotations
    """The invariant attention as one operator where the C++ kernel (attention_cpu.py, an operator of its
    own) does not serve, off the CPU or where it did not build: exact.attention, [n, heads, q, d] ->
    [n, q, heads, d], opaque to the compiler."""
    groups = query.shape[1] // key.shape[1]
    return exact.attention(_Groups(groups), query, key, value, mask, scaling=scaling)[0]


@attention_op.register_fake
def _(query, key, value, mask, scaling):
    n, heads, q, d = query.shape
    return query.new_empty((n, q, heads, d))


class _Groups:
    def __init__(self, groups: int):
        self.num_key_value_groups = groups


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """The attention interface of a compiled model: the invariant kernel as one opaque operator."""
    training = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if attention_mask is None or attention_mask.dtype != torch.bool or softcap is not None or training:
        # exact.attention's PyTorch operators: no bool mask, a softcap, or gradients the kernels do not give
        return exact.attention(module, query, key, value, attention_mask, dropout, scaling, softcap, **kwargs)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    kernel = _KERNEL[0]
    if kernel is not None and query.device.type == "cpu":  # the C++ operator itself: no Python around it
        return kernel(query, key, value, attention_mask, scale), None
    return attention_op(query, key, value, attention_mask, scale), None


NAME = "adaptive_spec_compiled"


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


_register()


# How a step is traced, active at every call since any call may recompile. Each patch is made once, here: making
# both at every call cost about 35 us a step more than entering and leaving them (about 20 us; thread-local).
_SHAPES = torch.fx.experimental._config.patch(  # type: ignore[attr-defined]  # installed at import by torch's config module
    backed_size_oblivious=True, use_duck_shape=False
)
# the modules' Python floats (norm epsilons, attention scalings: 93 on the default model) as constants of the
# graph, not inputs dynamo wraps in a tensor at every call (about 0.2-0.4 ms a step). Like the weights they
# must not change while a step serves: the guards skip the modules (CompiledStep.rebuild)
_FLOATS = torch._dynamo.config.patch(specialize_float=True)


def _compile(function: Callable) -> Callable:
    """`function` through torch.compile as every compiled forward here is: dynamic shapes, code of its own
    (`isolate_recompiles`), no guards on modules (CompiledStep.rebuild says why) and no size assertions."""
    return torch.compile(  # type: ignore[call-overload]  # torch's overloads lack isolate_recompiles
        function,
        dynamic=True,
        isolate_recompiles=True,
        options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            # inductor checks every input's and every library call's sizes and strides in Python, about
            # 650 checks a step; dynamo's guards already hold the inputs to the shapes compiled for
            "size_asserts": False,
            "alignment_asserts": False,
        },
    )


def draft_forward(forward: Callable) -> Callable:
    """A draft's forward, compiled: `forward(module, *tensors)` with the module an argument, so that every
    version of a draft (the base head and each adapter's, the same modules with other weights) runs the
    same compiled code. Its weights are inputs of the graph, read from the module passed at each call,
    not constants: with no guards on modules (`_compile`), a version's weights baked into the code
    would be served for every other version. tests/adaptive_spec/test_compiled.py holds that.

    A draft need not be invariant (the target verifies every token), only fast: on the default model in
    bf16 (AMD EPYC, 2 cores) a head's draft step took 1.29 ms eager and 0.9-1.0 ms compiled, of a 14 ms
    target step (docs/benchmarks.md, "The head's draft steps compiled")."""
    step = _compile(forward)

    def run(*args):
        with _SHAPES, _FLOATS:
            return step(*args)

    return run


class _Tap(nn.Module):
    """A decoder layer that also appends its output to `sink` (CompiledStep's `_taps`): inside the compiled step a
    list the graph returns the tensors of, as it returns its outputs."""

    def __init__(self, layer: nn.Module, sink: list):
        super().__init__()
        self.layer = layer
        self.sink = sink

    def forward(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.sink.append(out[0] if isinstance(out, tuple) else out)
        return out


class CompiledStep:
    """`model`'s step over rows 0..n-1 of a cache, compiled: (logits [n, width, vocab], the target's states
    [n, width, hidden * len(feeding.state_layers(model))]: the outputs of its state layers side by side, the last
    what enters the final norm)."""

    def __init__(self, model: exact.CausalLM):
        decoder = feeding.decoder_of(model)
        self.norm = decoder.norm
        self.lm_head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.hidden_size = int(model.config.hidden_size)
        # the decoder without its final norm: its output is what enters the norm; the state layers before the
        # last tapped
        self.decoder = copy.copy(decoder)
        self.decoder._modules = dict(decoder._modules)
        self.decoder._modules["norm"] = nn.Identity()
        self._taps: list[torch.Tensor] = []
        tapped = feeding.state_layers(model)[:-1]
        if tapped:
            layers = nn.ModuleList(decoder.layers)
            for i in tapped:
                layers[i] = _Tap(decoder.layers[i], self._taps)
            self.decoder._modules["layers"] = layers
        self.calls = 0
        self._columns: dict[tuple[int, torch.device], torch.Tensor] = {}  # width -> arange(width), made once
        # pad every one-token step to 2 columns, not only a lone row's (feeding.compiled_width); set by
        # exact.make_exact where the invariance check fails without it
        self.pad_plain_steps = False
        self.rebuild()

    def rebuild(self) -> None:
        """Compile afresh, with none of the code compiled so far (after the model's modules changed).

        Dynamo checks guards before every call; on the default model they took about 1.5 ms of a 12 ms
        step, most of them on the model's modules and weights. Those are left out
        (`skip_guard_on_all_nn_modules_unsafe`): the target's modules and weights do not change while
        an engine serves (its adapters go to the draft), and where they do change (`exact.make_exact`
        installing row chunks) the step is rebuilt. The guards on the inputs, the cache and the global
        state stay. Each step's compiled code is its own (`isolate_recompiles`), so a step never runs
        code compiled for another model in the same process, whose modules those guards would have told apart.

        Two more cuts of the per-step Python (Intel Xeon, 2 cores, default model, a lone row's step 17.3 ->
        16.1 ms): inductor's size and alignment assertions are off (`size_asserts`), and the cache buffers'
        heads and head dimension are constants (kv.py `_fixed_heads`), not symbols dynamo computes and passes
        in at every call for each of 60 buffers."""
        self._step = _compile(self._forward)

    def _forward(self, ids, positions, mask, cache, columns):
        states = self.decoder(
            input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True
        ).last_hidden_state
        logits = self.lm_head(self.norm(states.index_select(1, columns)))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self._taps:
            states = torch.cat([*self._taps, states], dim=-1)
            self._taps.clear()
        return logits, states

    def __call__(self, ids, positions, mask, cache, columns: torch.Tensor | None = None):
        """Logits `[n, len(columns), vocab]` at the given columns (default: every one) and the states at every
        column. A step wants every column's logits; a prompt's prefill only its last (feeding.feed): the LM head
        over all of a 512-token chunk's positions cost a quarter of its prefill on the default model. Which
        columns comes as a tensor, not a number, so that one graph serves both: dynamo would specialise on a
        number 1."""
        if columns is None:
            columns = self._every_column(ids.shape[1], ids.device)
        with _progress() if self.calls == 0 else contextlib.nullcontext(), _SHAPES, _FLOATS:
            out = self._step(ids, positions, mask, cache, columns)
        self.calls += 1
        return out

    def _every_column(self, width: int, device: torch.device) -> torch.Tensor:
        columns = self._columns.get((width, device))
        if columns is None:
            columns = self._columns[(width, device)] = torch.arange(width, device=device)
        return columns


@contextlib.contextmanager
def _progress():
    """The first call compiles: on a terminal a bar on stderr shows the time it has taken (the total is
    unknown: minutes the first time on a machine, seconds when the cache has it); elsewhere (a server's
    log file, a container's output) stderr gets a line at the start and one at the end, where a bar
    redrawn every second was a fragment a second on one long line. The log says the end either way."""
    started = time.perf_counter()
    done = threading.Event()
    bar = tqdm(
        desc="compiling the decoding step",
        bar_format="{desc}: {elapsed}",
        file=sys.stderr,
        leave=False,
        disable=None,  # None: a terminal only
    )

    def tick() -> None:
        while not done.wait(1.0):
            bar.update(0)
            bar.refresh()

    ticker = None if bar.disable else threading.Thread(target=tick, name="compile-progress", daemon=True)
    if ticker is None:
        print(
            "compiling the decoding step: minutes the first time on a machine, seconds once its cache has it",
            file=sys.stderr,
            flush=True,
        )
    else:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
        bar.close()
        took = time.perf_counter() - started
        if bar.disable:
            print(f"compiled the decoding step in {took:.0f} s", file=sys.stderr, flush=True)
        log.info("compiled the decoding step in %.0f s", took)


_CACHE_SET: list[str | None] = [None]  # the inductor cache directory use_cache_dir last chose


def use_cache_dir(cache_dir: Path | str) -> None:
    """Keep inductor's compiled code (its FX graph cache) in `cache_dir`, unless the user chose a directory
    with TORCHINDUCTOR_CACHE_DIR. Inductor writes its default (/tmp/torchinductor_<user>) into that
    variable the first time it asks for a cache directory, which importing the engine already does, so
    a value equal to that default is taken as unset. Before this, the variable was only set when
    absent, and it never was: compiled code went to /tmp, and a machine whose /tmp is wiped (a
    container's restart) compiled again at every start."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    ours = (os.path.abspath(default_cache_dir()), _CACHE_SET[0])
    if current is None or os.path.abspath(current) in ours:
        chosen = os.path.abspath(cache_dir)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
        _CACHE_SET[0] = chosen


def install(model: exact.CausalLM, cache_dir: Path | str | None = None) -> CompiledStep:
    """Run `model`'s full-batch steps compiled (feeding.feed); its attention becomes the invariant kernel
    behind an opaque operator. `cache_dir` keeps compiled code between processes."""
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        use_cache_dir(cache_dir)
    parameter = next(model.parameters())
    extensions = Path(cache_dir) / "extensions" if cache_dir is not None else None
    if parameter.device.type == "cpu" and _KERNEL[0] is None:
        _KERNEL[0] = attention_cpu.load(extensions)
    if parameter.device.type == "cpu" and parameter.dtype == torch.bfloat16 and exact.COMPILED_LINEAR[0] is None:
        exact.COMPILED_LINEAR[0] = linear_bf16.load(extensions)  # the row-invariant product, an operator
    exact.install(model)
    model.set_attn_implementation(NAME)
    step = CompiledStep(model)
    feeding.COMPILED[model] = step
    return step


def use_kernel(model: nn.Module) -> None:
    """Run a draft's attention through the invariant C++ kernel as well, when it built, in its eager
    forwards (a prompt's catch-up, every forward of a draft with no compiled path); its attention was exact.attention's
    fp32 products over every query and key, the largest part of a head's prefill over a prompt. The
    draft's numbers change in the last bits, which only its proposals see (the target verifies)."""
    if _KERNEL[0] is None:
        return
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == exact.NAME:
            config._attn_implementation = NAME


def uninstall(model: exact.CausalLM) -> None:
    """Back to the eager invariant kernels."""
    feeding.COMPILED.pop(model, None)
    model.set_attn_implementation(exact.NAME)
