"""Training a head draft (trainer/learning/head_distill.py) on a tiny random Llama built in code, and serving
what it saves.

Run: .venv/bin/python -m pytest tests/trainer/test_head_distill.py -q   (CPU, one thread, about 40 s)

What must hold:

- the states the trainer computes are the target's own, lined up as the head reads them: through
  the target's final norm and LM head they give back the top-1 the target logged at every output
  position, and the head reads the state at t - 1 beside token t;
- on a one-layer target, a head that is that layer (its fuse passes the embedding alone) is the
  target: the gate scores it 1.0, and so does every step of an unrolled chain, which checks the
  attention pattern of the steps drafted on the head's own states;
- training raises the held-out greedy match of the first draft token and of the chained steps well
  above the base head, lr = 0 changes nothing, and only LoRA weights and the fuse train: the target
  stays bit for bit the same;
- a saved version is a PEFT directory on DraftHead that the engine serves (same predicted states as
  the trainer's head, greedy output identical to the target alone), reloads into a trainer, and is
  refused when corrupt or made for another draft, exactly like an early-exit adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

# pytest --import-mode=importlib adds no test dir; the tiny models live with the engine tests.
from adapter_files import make_adapter
from tiny import llama
from traffic import greedy_records

from adaptive_spec import Engine
from adaptive_spec.cache import feeding
from adaptive_spec.contracts import METADATA_FILE
from adaptive_spec.formats.adapters import AdapterDir, AdapterError
from adaptive_spec.formats.record import CorrectionRecord, record_from_output
from adaptive_spec.models import native_bf16
from trainer.evaluation.gate import Gate, GateFigures, adapters_disabled, draft_agreement
from trainer.intake.buffer import HoldoutSplit
from trainer.intake.examples import examples_from_record
from trainer.learning.distill import LoraSettings, position_losses, training_autocast
from trainer.learning.head_distill import HeadSettings, HeadTrainer, softmax_columns
from trainer.learning.head_model import TrainableHead, head_batch, unrolled

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
STEPS = 120
SETTINGS = HeadSettings(batch_tokens=512, r=8, unroll=2)


@dataclass
class Run:
    target: torch.nn.Module
    weights_before: dict[str, torch.Tensor]
    train_records: list[CorrectionRecord]
    holdout: list[CorrectionRecord]
    base: GateFigures  # the head as served without a version
    trainer: HeadTrainer
    trained: GateFigures
    broken: GateFigures  # the lr = 0 trainer
    start: GateFigures  # a trainer before any step (its fuse starts as [I | c I])
    losses: list[float]


def train(target, records, settings: HeadSettings, steps: int = STEPS) -> tuple[HeadTrainer, list[float]]:
    trainer = HeadTrainer(TrainableHead(target), settings, target_id="tiny-llama", draft_id="head")
    examples = [examples_from_record(each) for each in records]
    rng = np.random.default_rng(0)
    losses = [trainer.train_step([examples[i] for i in rng.permutation(len(examples))[:12]]) for _ in range(steps)]
    return trainer, losses


@pytest.fixture(scope="module")
def run() -> Run:
    target = llama(0, vocab=VOCAB)
    weights_before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    records = greedy_records(target, 160, new_tokens=24)
    split = HoldoutSplit(fraction=0.25)
    train_records = [each for each in records if not split.add(each)]
    base = draft_agreement(TrainableHead(target), split.records)
    start = draft_agreement(HeadTrainer(TrainableHead(target), SETTINGS).model, split.records)
    trainer, losses = train(target, train_records, SETTINGS)
    broken, _ = train(target, train_records, HeadSettings(batch_tokens=512, r=8, lr=0.0), steps=5)
    return Run(
        target,
        weights_before,
        train_records,
        split.records,
        base,
        trainer,
        draft_agreement(trainer.model, split.records),
        draft_agreement(broken.model, split.records),
        start,
        losses,
    )


# ---------------------------------------------------------------- what the head reads


def test_the_states_are_the_targets_own_lined_up_as_the_head_reads_them(run):
    head = TrainableHead(run.target)
    record = run.holdout[0]
    example = examples_from_record(record)
    batch = head_batch(head, [(record, example)])
    with torch.no_grad():
        logits = run.target.lm_head(run.target.model.norm(batch.states[0]))  # [seq, vocab]
    # The state at the column that predicts output j gives the target's own choice of output j.
    top1 = torch.from_numpy(record.target_topk_ids[:, 0])
    assert torch.equal(logits[example.positions].argmax(-1), top1)
    assert torch.equal(top1, torch.tensor(record.output_ids))  # greedy traffic
    # Beside token t the head reads the state at t - 1 (the target's state layers side by side, the last layer's
    # last); zeros before position 0.
    hidden = run.target.config.hidden_size
    assert head.feature_layers == feeding.state_layers(run.target) == (1, 3)
    assert batch.features.shape[-1] == 2 * hidden and batch.states.shape[-1] == hidden
    assert torch.equal(batch.features[0, 1:, hidden:], batch.states[0, :-1]) and not batch.features[0, 0].any()
    with feeding.capture_states(run.target) as captured, torch.no_grad():
        run.target.model(input_ids=torch.tensor([example.input_ids.tolist()]), use_cache=False)
    assert torch.allclose(batch.features[0, 1:], captured[0][0, :-1].half().float())  # kept in fp16
    assert len(head.states) == 1 and head.states.forwards == 1  # one target forward, kept with the record
    head_batch(head, [(record, example)])
    assert head.states.forwards == 1


def test_a_head_that_is_a_one_layer_target_scores_one_at_every_chained_step():
    target = llama(3, vocab=VOCAB, layers=1)
    engine = Engine(target, "head", k=2, record_topk=8, eos_token_id=[])
    rng = np.random.default_rng(1)
    records = [
        record_from_output(
            engine.generate(rng.integers(0, 16, 8).tolist(), max_new_tokens=16),
            request_id=f"r{i}",
            created_at=0.0,
            domain=None,
            target_id="tiny",
            draft_id="head",
            temperature=0.0,
        )
        for i in range(12)
    ]
    head = TrainableHead(target)
    hidden = target.config.hidden_size
    with torch.no_grad():  # the layer sees exactly the token's embedding, as the target's layer does
        head.fuse.weight.copy_(torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1))
    assert draft_agreement(head, records).greedy_match == 1.0
    chain = head.chain_figures(records, depth=3)
    assert chain["match"] == [1.0, 1.0, 1.0]
    # Chains that start in the last two output positions run past the output: 12 x 16 chains in all.
    assert chain["chains"] == 12 * 16 and chain["accepted_per_round"] == pytest.approx((14 * 3 + 2 + 1) / 16)


def test_a_head_on_several_layers_starts_as_one_on_the_last_alone():
    """EAGLE-3's fused features: the reduction [layers * hidden -> hidden] starts as the last layer's block alone,
    so a new head, and a version trained before the reduction existed, read what a head on the last layer
    reads."""
    target = llama(5, vocab=VOCAB)
    records = greedy_records(target, 12, new_tokens=16)
    fused, last = TrainableHead(target), TrainableHead(target, feature_layers=(3,))
    assert fused.reduce is not None and last.reduce is None
    assert draft_agreement(fused, records) == draft_agreement(last, records)
    example = examples_from_record(records[0])
    wide, narrow = head_batch(fused, [(records[0], example)]), head_batch(last, [(records[0], example)])
    with torch.no_grad():
        assert torch.equal(fused(wide.input_ids, wide.features), last(narrow.input_ids, narrow.features))
    with pytest.raises(ValueError, match="end at the last layer"):
        TrainableHead(target, feature_layers=(1, 2))


def test_unrolled_steps_read_the_heads_own_previous_prediction():
    target = llama(4, vocab=VOCAB, layers=2)
    head = TrainableHead(target)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    features = torch.randn(2, 9, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first, second = unrolled(head, ids, features, 2)
        assert torch.allclose(first, head(ids, features), atol=1e-5)  # step 1 is the plain causal pass
        # Step 2 at t = 5, by hand: keys of step 1 at 0..4, then its own input (P_1[4], token 5).
        cache = _Cache()
        head(ids[:, :5], features[:, :5], None, None, cache)
        by_hand = head(ids[:, 5:6], first[:, 4:5], torch.tensor([[5], [5]]), None, cache)
    assert torch.allclose(second[:, 5], by_hand[:, 0], atol=1e-5)


class _Cache:
    def __init__(self):
        self.keys = self.values = None

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.keys = key if self.keys is None else torch.cat([self.keys, key], dim=2)
        self.values = value if self.values is None else torch.cat([self.values, value], dim=2)
        return self.keys, self.values


# ---------------------------------------------------------------- learning


def test_training_raises_heldout_agreement_and_lr0_changes_nothing(run):
    chains = {
        name: head.chain_figures(run.holdout, depth=2)
        for name, head in [
            ("start", HeadTrainer(TrainableHead(run.target), SETTINGS).head),
            ("trained", run.trainer.head),
        ]
    }
    print(
        f"\nheld-out {run.base.positions} positions\n  base    {run.base}\n  start   {run.start}\n"
        f"  trained {run.trained}\n  lr=0    {run.broken}\n  chains  {chains}\n"
        f"  loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}"
    )
    assert run.broken == run.start  # AdamW at lr 0: the weights the trainer starts from
    with adapters_disabled(run.trainer.model):  # LoRA off and the fuse back to [I | I]: the served base head
        assert draft_agreement(run.trainer.model, run.holdout) == run.base
    # Measured (seed 0, 120 steps): greedy match 0.36 (base) / 0.22 (start) -> 0.46; the second chained
    # step 0.51 -> 0.66. The paired noise over ~1,000 positions is about 0.02.
    assert run.trained.positions == run.base.positions >= 900
    assert run.trained.greedy_match >= max(run.base.greedy_match, run.start.greedy_match) + 0.05
    assert chains["trained"]["match"][1] >= chains["start"]["match"][1] + 0.08
    assert np.mean(run.losses[-10:]) < 0.8 * np.mean(run.losses[:10])
    assert Gate(min_positions=900).decide(run.trained, run.base)[0]


def test_autocast_runs_a_steps_forwards_in_bf16_and_keeps_the_weights_and_gradients_fp32(run):
    examples = [examples_from_record(each) for each in run.train_records[:12]]
    steps = {}
    for mode in ("off", "bf16"):
        trainer = HeadTrainer(TrainableHead(run.target), replace(SETTINGS, autocast=mode))
        seen: list[torch.dtype] = []
        hooks = [  # the head's own layer, and the target's forward for the states it reads
            module.register_forward_hook(lambda _module, _args, out, seen=seen: seen.append(out.dtype))
            for module in (trainer.head.layer.mlp.down_proj, run.target.model.layers[0].mlp.down_proj)
        ]
        try:
            loss = trainer.train_step(examples)
        finally:
            for hook in hooks:
                hook.remove()
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        assert {p.dtype for p in trained} == {torch.float32}
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trained)
        steps[mode] = (loss, set(seen))
    assert steps["off"][1] == {torch.float32}
    assert steps["bf16"][1] == {torch.bfloat16}
    # The same first step from the same start: bf16 rounding moves the loss by well under 5%.
    assert steps["bf16"][0] == pytest.approx(steps["off"][0], rel=0.05)


def test_autocast_auto_is_on_only_for_fp32_weights_of_a_wide_model_on_a_device_with_native_bf16():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert training_autocast("auto", cpu, torch.float32, 576) == native_bf16(cpu)
    assert not training_autocast("auto", cpu, torch.float32, 64)  # the tests' tiny models: casts cost more
    assert not training_autocast("auto", cpu, torch.bfloat16, 576)
    assert not training_autocast("auto", cuda, torch.bfloat16, 576)  # a GPU trains in bf16 weights already
    assert training_autocast("auto", cuda, torch.float32, 576)
    assert training_autocast("bf16", cpu, torch.float32, 64) and not training_autocast("off", cpu, torch.float32, 576)
    with pytest.raises(ValueError, match="autocast must be one of"):
        LoraSettings(autocast="fp8")


def test_the_batch_softmax_is_the_vocabulary_softmax_over_the_batch_tokens_alone(run):
    head = TrainableHead(run.target)
    batch = head_batch(head, [(each, examples_from_record(each)) for each in run.train_records[:2]])
    columns = torch.unique(batch.target_topk_ids)
    assert 8 <= columns.numel() < VOCAB  # some tokens are left out, so the two softmaxes differ
    states = torch.randn(len(batch.rows), run.target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    logits, ids = softmax_columns(head, batch.target_topk_ids, "batch")
    with torch.no_grad():
        full = head.logits(states)  # [positions, VOCAB]
        assert torch.allclose(logits(states), full[:, columns], atol=1e-6)
        assert torch.equal(columns[ids], batch.target_topk_ids)
        # The KL over the batch's tokens is the whole vocabulary's with every other token's logit at -inf ...
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[columns] = False
        kl = position_losses(logits(states), ids, batch.target_topk_logprobs)
        masked = position_losses(
            full.masked_fill(outside, -torch.inf), batch.target_topk_ids, batch.target_topk_logprobs
        )
        assert torch.allclose(kl, masked, atol=1e-5)
        # ... so it is at most the vocabulary's, and "vocab" is the whole vocabulary's.
        whole = position_losses(full, batch.target_topk_ids, batch.target_topk_logprobs)
        assert bool((kl <= whole + 1e-5).all()) and not torch.allclose(kl, whole)
        logits, ids = softmax_columns(head, batch.target_topk_ids, "vocab")
        assert torch.equal(logits(states), full) and ids is batch.target_topk_ids
    with pytest.raises(ValueError, match="softmax must be one of"):
        HeadSettings(softmax="everything")


def test_only_lora_and_the_fuse_train_and_the_target_is_untouched(run):
    after = run.target.state_dict()
    assert all(torch.equal(after[name], before) for name, before in run.weights_before.items())
    assert not any("lora" in name for name, _ in run.target.named_modules())
    trainable = [name for name, p in run.trainer.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 + 2  # A and B on the layer's 7 projections, the fuse's and reduction's copies
    assert all(
        ("lora_" in name and ".layer." in name)
        or name.endswith(("fuse.modules_to_save.default.weight", "reduce.modules_to_save.default.weight"))
        for name in trainable
    )
    assert all(p.grad is None for p in run.target.parameters())


def test_reset_and_restore_return_to_the_start_and_to_a_copy(run):
    trainer, _ = train(run.target, run.train_records, SETTINGS, steps=3)
    saved = trainer.lora_state()
    trainer.train_step([examples_from_record(each) for each in run.train_records[:4]])
    assert draft_agreement(trainer.model, run.holdout) != draft_agreement(_restored(trainer, saved), run.holdout)
    trainer.restore(saved)
    assert all(torch.equal(saved[name], p) for name, p in trainer.model.named_parameters() if p.requires_grad)
    trainer.reset()
    assert draft_agreement(trainer.model, run.holdout) == run.start


def _restored(trainer: HeadTrainer, saved) -> torch.nn.Module:
    copy = HeadTrainer(TrainableHead(trainer.head.states.target), SETTINGS)
    copy.restore(saved)
    return copy.model


# ---------------------------------------------------------------- versions: save, serve, refuse


def test_a_saved_version_reloads_into_a_trainer_with_the_same_figures(run, tmp_path):
    path = run.trainer.save(tmp_path / "v1")
    assert {"adapter_config.json", "adapter_model.safetensors", METADATA_FILE} <= {p.name for p in path.iterdir()}
    metadata = AdapterDir(path).metadata().to_dict()
    assert metadata["draft_id"] == "head" and metadata["draft_config"]["kind"] == "head"
    assert metadata["steps"] == STEPS and metadata["settings"]["unroll"] == 2
    champion = HeadTrainer(TrainableHead(run.target), HeadSettings(r=4), init_adapter=path)
    assert champion.settings.r == 8  # the version's own shape wins
    assert draft_agreement(champion.model, run.holdout) == run.trained
    with pytest.raises(ValueError, match="does not fit"):
        HeadTrainer(TrainableHead(run.target), HeadSettings(r=4)).load(path)


def test_the_engine_serves_a_version_as_the_trainer_trained_it_and_stays_lossless(run, tmp_path):
    path = run.trainer.save(tmp_path / "v1")
    engine = Engine(run.target, "head", eos_token_id=[])
    prompts = [each.prompt_ids for each in run.holdout[:6]]
    plain = [engine.generate(p, max_new_tokens=24, speculative=False).token_ids for p in prompts]
    base = engine.generate_batch(prompts, max_new_tokens=24, k=3)
    engine.load_adapter(path, "1")
    served = engine.adapters.general.weights  # the DraftHead the drafter decodes with
    batch = head_batch(run.trainer.head, [(r, examples_from_record(r)) for r in run.holdout[:3]])
    with torch.no_grad():
        assert torch.allclose(
            served(batch.input_ids, batch.features), run.trainer.head(batch.input_ids, batch.features), atol=1e-4
        )
    outputs = engine.generate_batch(prompts, max_new_tokens=24, k=3)
    assert [out.token_ids for out in outputs] == plain == [out.token_ids for out in base]
    accepted = sum(out.stats.accepted for out in outputs) / sum(out.stats.drafted for out in outputs)
    accepted_base = sum(out.stats.accepted for out in base) / sum(out.stats.drafted for out in base)
    print(f"\nserved acceptance: base head {accepted_base:.3f}, version {accepted:.3f}")
    assert accepted > accepted_base
    assert {out.stats.adapter_version for out in outputs} == {"1"}


def test_a_version_from_before_the_reduction_serves_and_trains_on_as_before(run, tmp_path):
    """A version trained on the last layer alone (no reduction saved) serves as it was trained, through the
    head's reduction at its start, and a lineage continued from it keeps reading the last layer alone."""
    old = HeadTrainer(TrainableHead(run.target, feature_layers=(3,)), SETTINGS)
    examples = [examples_from_record(each) for each in run.train_records[:24]]
    for _ in range(3):
        old.train_step(examples)
    path = old.save(tmp_path / "old")
    assert AdapterDir(path).metadata().to_dict()["draft_config"]["feature_layers"] == [3]
    engine = Engine(run.target, "head", eos_token_id=[])
    engine.load_adapter(path, "1")
    served = engine.adapters.general.weights
    record = run.holdout[0]
    wide = head_batch(TrainableHead(run.target), [(record, examples_from_record(record))])
    narrow = head_batch(old.head, [(record, examples_from_record(record))])
    with torch.no_grad():
        assert torch.allclose(
            served(wide.input_ids, wide.features), old.head(narrow.input_ids, narrow.features), atol=1e-4
        )
    continued = HeadTrainer(TrainableHead(run.target), SETTINGS, init_adapter=path)
    assert continued._reduce is None  # nothing to continue: the reduction stays at the last layer
    assert draft_agreement(continued.model, run.holdout) == draft_agreement(old.model, run.holdout)
    saved = continued.save(tmp_path / "continued")
    assert AdapterDir(saved).metadata().to_dict()["draft_config"]["feature_layers"] == [3]


def test_a_corrupt_or_mismatched_head_is_refused_and_the_served_one_stays(run, tmp_path):
    good = AdapterDir(run.trainer.save(tmp_path / "good"))
    good.seal(version=1)
    engine = Engine(run.target, "head", eos_token_id=[])
    engine.load_adapter(good.path, "1")

    corrupt = AdapterDir(run.trainer.save(tmp_path / "corrupt"))
    corrupt.seal(version=2)
    data = bytearray(corrupt.weights.read_bytes())
    data[-5] ^= 0xFF
    corrupt.weights.write_bytes(bytes(data))
    with pytest.raises(AdapterError) as refused:
        engine.load_adapter(corrupt.path, "2")
    assert refused.value.reason == "checksum"

    make_adapter(run.target, 2, tmp_path / "early-exit", seed=3)  # an early-exit:2 adapter
    with pytest.raises(AdapterError, match="head's layer"):
        engine.load_adapter(tmp_path / "early-exit", "3")

    wider = HeadTrainer(TrainableHead(llama(0, vocab=VOCAB, hidden=96)), HeadSettings(r=8)).save(tmp_path / "wider")
    with pytest.raises(AdapterError, match=r"does not fit|the module is"):
        engine.load_adapter(wider, "4")
    deeper = HeadTrainer(TrainableHead(llama(0, vocab=VOCAB, layers=8)), HeadSettings(r=8)).save(tmp_path / "deeper")
    with pytest.raises(AdapterError, match=r"reduce: \(64, 192\) does not fit this head's \(64, 128\)"):
        engine.load_adapter(deeper, "5")  # the state layers of an 8-layer target: (1, 3, 7)
    assert engine.adapter_version == "1"  # every refusal left the served head in place

    with pytest.raises(AdapterError):  # and a head version is not an early-exit adapter
        Engine(run.target, "early-exit:2").load_adapter(good.path, "5")
