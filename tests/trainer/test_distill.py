"""Distillation into a LoRA adapter on an early-exit draft, on a tiny random Llama built in code.

Run: .venv/bin/python -m pytest tests/trainer/test_distill.py -q   (CPU, one thread, about 15 s)

What must hold:

- a record becomes a teacher-forced example whose positions line up with what the live engine
  drafted and what the target logged, and long records lose prompt tokens first;
- the loss is the forward KL of the worked example in trainer/learning/distill.py, renormalised over the top-m;
- training on the train split raises the held-out greedy match and expected acceptance well above
  the base draft, while the same trainer at lr = 0 leaves both exactly at the base figures;
- the target's weights stay bit for bit the same: only LoRA weights on the draft's private layers train;
- a saved adapter is a standard PEFT directory: it reloads into a trainer (the champion to continue
  from) and into a plain draft with transformers' load_adapter, giving the same figures.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

# pytest --import-mode=importlib adds no test dir; the tiny models live with the engine tests.
from tiny import llama

from adaptive_spec import Engine
from adaptive_spec.contracts import METADATA_FILE
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.adapters import AdapterDir
from adaptive_spec.formats.record import CorrectionRecord
from trainer.evaluation.gate import Gate, GateFigures, adapters_disabled, draft_agreement, draft_logits
from trainer.intake.buffer import HoldoutSplit, ReplayBuffer
from trainer.intake.examples import collate, examples_from_record
from trainer.learning.distill import DraftTrainer, LoraSettings, position_losses

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
DOMAIN_TOKENS = 16  # prompts use tokens 0..15 only: a narrow domain, as drifted traffic is
PROMPT_LEN, NEW_TOKENS, TOP_M = 8, 24, 8
STEPS = 150
SETTINGS = LoraSettings(batch_tokens=512)  # the default lr (1e-3), r = 16 on all 7 projections


def greedy_records(target, draft, count: int, seed: int = 0) -> list[CorrectionRecord]:
    """Greedy outputs of `target` for random domain prompts, logged as a k = 1 speculation would
    log them: at every position the base draft proposed its argmax, accepted when it is the output."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, DOMAIN_TOKENS, (count, PROMPT_LEN), generator=generator)  # [count, prompt]
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        target_logits = target(ids[:, :-1]).logits[:, PROMPT_LEN - 1 :]  # [count, new, vocab]
        target_logprobs = torch.log_softmax(target_logits, dim=-1)
        proposed = draft(ids[:, :-1]).logits[:, PROMPT_LEN - 1 :].argmax(-1)  # [count, new]
    top = target_logprobs.topk(TOP_M, dim=-1)
    outputs = ids[:, PROMPT_LEN:]  # [count, new]
    return [
        record(
            f"req-{seed}-{i}",
            ids[i, :PROMPT_LEN],
            outputs[i],
            proposed[i],
            proposed[i] == outputs[i],
            top.indices[i],
            top.values[i],
        )
        for i in range(count)
    ]


def record(
    request_id, prompt_ids, output_ids, proposed, accepted, topk_ids, topk_logprobs, temperature: float = 0.0
) -> CorrectionRecord:
    return CorrectionRecord(
        request_id=request_id,
        created_at=0.0,
        domain="tiny",
        target_id="tiny-llama",
        draft_id="early-exit:1",
        adapter_version=None,
        temperature=temperature,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        proposed=proposed,
        accepted=accepted,
        target_topk_ids=topk_ids,
        target_topk_logprobs=topk_logprobs,
    )


def train(target, records, settings: LoraSettings, steps: int = STEPS) -> tuple[DraftTrainer, list[float]]:
    trainer = DraftTrainer(build_early_exit(target, 1), settings, target_id="tiny-llama", draft_id="early-exit:1")
    buffer = ReplayBuffer(max_tokens=100_000)
    for each in records:
        buffer.add(examples_from_record(each))
    rng = np.random.default_rng(1)
    losses = [trainer.train_step(buffer.sample_batch(rng, settings.batch_tokens)) for _ in range(steps)]
    return trainer, losses


@dataclass
class Run:
    target: torch.nn.Module
    weights_before: dict[str, torch.Tensor]
    train_records: list[CorrectionRecord]
    holdout: list[CorrectionRecord]
    base: GateFigures  # the plain early-exit draft
    trained: GateFigures
    broken: GateFigures  # the lr = 0 trainer
    trainer: DraftTrainer
    losses: list[float]
    train_s: float


@pytest.fixture(scope="module")
def run() -> Run:
    target = llama(0, vocab=VOCAB)
    weights_before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    records = greedy_records(target, build_early_exit(target, 1), 200)
    split = HoldoutSplit(fraction=0.25)
    train_records = [each for each in records if not split.add(each)]
    base = draft_agreement(build_early_exit(target, 1), split.records)
    started = time.perf_counter()
    trainer, losses = train(target, train_records, SETTINGS)
    train_s = time.perf_counter() - started
    broken, _ = train(target, train_records, LoraSettings(batch_tokens=512, lr=0.0))
    trained = draft_agreement(trainer.model, split.records)
    return Run(
        target,
        weights_before,
        train_records,
        split.records,
        base,
        trained,
        draft_agreement(broken.model, split.records),
        trainer,
        losses,
        train_s,
    )


# ---------------------------------------------------------------- records to examples


def test_example_lines_up_output_positions_with_the_logits_that_predict_them():
    # prompt [10 11 12], output [20 21 22]: the input is [10 11 12 20 21]; the logits after 12
    # (index 2) predict 20, after 20 (index 3) predict 21, after 21 (index 4) predict 22.
    logprobs = np.log([[0.6, 0.3], [0.5, 0.4], [0.9, 0.05]])
    each = record(
        "r", [10, 11, 12], [20, 21, 22], [20, 5, -1], [True, False, False], [[20, 7], [21, 5], [22, 3]], logprobs
    )
    example = examples_from_record(each)
    assert example.input_ids.tolist() == [10, 11, 12, 20, 21]
    assert example.positions.tolist() == [2, 3, 4]
    assert example.accepted.tolist() == [True, False, False]
    assert example.target_topk_ids.tolist() == [[20, 7], [21, 5], [22, 3]]
    assert example.target_topk_logprobs.dtype == torch.float16  # as logged, renormalised only in the loss

    # max_seq_len 4: one prompt token goes, every output position stays.
    cut = examples_from_record(each, max_seq_len=4)
    assert cut.input_ids.tolist() == [11, 12, 20, 21] and cut.positions.tolist() == [1, 2, 3]
    # max_seq_len 2: the whole prompt and the first output go; the logits predicting 20 and 21 are gone.
    cut = examples_from_record(each, max_seq_len=2)
    assert cut.input_ids.tolist() == [20, 21] and cut.positions.tolist() == [0, 1]
    assert cut.target_topk_ids[:, 0].tolist() == [21, 22] and cut.accepted.tolist() == [False, False]


def test_record_without_top_m_teaches_its_greedy_tokens_only():
    empty = np.zeros((2, 0))
    greedy = examples_from_record(record("g", [1, 2], [3, 4], [-1, -1], [False, False], empty, empty))
    assert greedy.target_topk_ids.tolist() == [[3], [4]] and greedy.target_topk_logprobs.tolist() == [[0.0], [0.0]]
    sampled = examples_from_record(record("s", [1, 2], [3, 4], [-1, -1], [False, False], empty, empty, temperature=0.8))
    assert sampled.num_positions == 0


def test_examples_line_up_with_what_the_engine_drafted_and_the_target_logged():
    target = llama(0, vocab=VOCAB)
    engine = Engine(target, "early-exit:1", k=3, record_topk=TOP_M, eos_token_id=[])
    rng = np.random.default_rng(3)
    records = []
    for i in range(4):
        out = engine.generate(rng.integers(0, VOCAB, 5 + i).tolist(), max_new_tokens=16)
        records.append(
            record(
                f"e{i}",
                out.prompt_ids,
                out.token_ids,
                out.proposed,
                out.accepted,
                out.target_topk_ids,
                out.target_topk_logprobs,
            )
        )
    batch = collate([examples_from_record(each) for each in records])
    with torch.no_grad():
        draft_argmax = draft_logits(build_early_exit(target, 1), batch).argmax(-1)  # [positions]
        target_logprobs = torch.log_softmax(draft_logits(target, batch), dim=-1)  # [positions, vocab]
    proposed = torch.tensor([p for each in records for p in each.proposed])
    accepted = torch.tensor([a for each in records for a in each.accepted])
    drafted = proposed >= 0
    assert drafted.sum() > 20 and accepted.sum() > 0
    # The engine drafted with a KV cache on exactly the context the example feeds.
    assert torch.equal(draft_argmax[drafted], proposed[drafted])
    assert torch.equal(accepted[drafted], (proposed == batch.target_topk_ids[:, 0])[drafted])
    logged = target_logprobs.gather(-1, batch.target_topk_ids)  # [positions, m]
    torch.testing.assert_close(logged, batch.target_topk_logprobs, atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------- the loss


def test_kl_is_the_worked_example_renormalised_over_the_top_m():
    # The docstring's example: logged probabilities (0.20, 0.05) renormalise to (0.8, 0.2); the
    # draft puts (0.5, 0.1) there and 0.4 on a third token.
    draft = torch.log(torch.tensor([[0.5, 0.1, 0.4]]))  # [1, vocab 3]
    ids = torch.tensor([[0, 1]])
    expected = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.1)  # 0.515
    loss = position_losses(draft, ids, torch.log(torch.tensor([[0.20, 0.05]])))
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    # A padded column (-inf) adds nothing and leaves the gradient finite.
    padded_draft = draft.clone().requires_grad_(True)
    padded = position_losses(padded_draft, torch.tensor([[0, 1, 2]]), torch.log(torch.tensor([[0.20, 0.05, 0.0]])))
    padded.sum().backward()
    assert padded.item() == pytest.approx(expected, abs=1e-5) and torch.isfinite(padded_draft.grad).all()
    # A draft that equals the renormalised target on the top-m pays nothing.
    perfect = position_losses(torch.log(torch.tensor([[0.8, 0.2, 0.0]])), ids, torch.log(torch.tensor([[0.2, 0.05]])))
    assert perfect.item() == pytest.approx(0.0, abs=1e-6)
    # ce_top1 is -log q(top-1), whatever the order of the columns.
    ce = position_losses(draft, torch.tensor([[1, 0]]), torch.log(torch.tensor([[0.05, 0.20]])), loss="ce_top1")
    assert ce.item() == pytest.approx(-math.log(0.5), abs=1e-6)


def test_step_loss_is_the_weighted_mean_and_micro_batches_change_nothing(run):
    # fp32 throughout: the arithmetic is checked to 1e-5, which bf16 autocast (the default on CPUs with
    # native bf16) rounds past
    settings = LoraSettings(batch_tokens=4096, accepted_weight=0.25, rejected_weight=1.0, autocast="off")
    examples = [examples_from_record(each) for each in run.train_records[:6]]
    assert any(example.accepted.any() for example in examples)
    one, split = (DraftTrainer(build_early_exit(run.target, 1), settings) for _ in range(2))
    split.settings.batch_tokens = 40  # one example per forward pass

    batch = collate(examples)
    with torch.no_grad():
        losses = position_losses(draft_logits(one.model, batch), batch.target_topk_ids, batch.target_topk_logprobs)
    weights = torch.where(batch.accepted, 0.25, 1.0)
    expected = float((weights * losses).sum() / weights.sum())

    assert one.train_step(examples) == pytest.approx(expected, rel=1e-5)
    assert split.train_step(examples) == pytest.approx(expected, rel=1e-5)
    for (name, a), (_, b) in zip(one.model.named_parameters(), split.model.named_parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_zero_weight_steps_nothing(run):
    accepted_only = [e for e in map(examples_from_record, run.train_records) if e.accepted.all()]
    if not accepted_only:  # make one: the same positions, all accepted
        example = examples_from_record(run.train_records[0])
        example.accepted[:] = True
        accepted_only = [example]
    trainer = DraftTrainer(build_early_exit(run.target, 1), LoraSettings(accepted_weight=0.0))
    before = [p.clone() for p in trainer.model.parameters() if p.requires_grad]
    assert trainer.train_step(accepted_only) == 0.0 and trainer.steps == 0
    assert all(
        torch.equal(a, b)
        for a, b in zip(before, (p for p in trainer.model.parameters() if p.requires_grad), strict=True)
    )
    with pytest.raises(ValueError, match="at least one example"):
        trainer.train_step([])


# ---------------------------------------------------------------- learning


def test_training_raises_heldout_agreement_and_lr0_changes_nothing(run):
    print(
        f"\nheld-out ({len(run.holdout)} records, {run.base.positions} positions; {len(run.train_records)} "
        f"train records, {STEPS} steps in {run.train_s:.1f} s)\n  base    {run.base}\n  trained {run.trained}\n"
        f"  lr=0    {run.broken}\n  loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}"
    )
    # The broken trainer: AdamW at lr 0 never moves LoRA's B off zero, so the draft is the base draft.
    assert run.broken == run.base
    with adapters_disabled(run.trainer.model):
        assert draft_agreement(run.trainer.model, run.holdout) == run.base
    # Measured over 4 target seeds (this setup, 150 steps): held-out greedy match +0.26..+0.35 and
    # expected acceptance +0.049..+0.079 over the base draft (seed 0: 0.14 -> 0.45, 0.19 -> 0.26).
    # The paired noise of a greedy-match difference over ~1,200 positions is about 0.02, so +0.15
    # is far outside noise yet half the smallest gain seen. Expected acceptance is capped by the
    # target's top-8 mass (0.35 for this flat random model), hence the smaller +0.025 bar.
    assert run.trained.positions == run.base.positions >= 900
    assert run.trained.greedy_match >= run.base.greedy_match + 0.15
    assert run.trained.expected_acceptance >= run.base.expected_acceptance + 0.025
    assert np.mean(run.losses[-10:]) < 0.8 * np.mean(run.losses[:10])
    assert Gate(min_positions=900).decide(run.trained, run.base)[0]
    assert not Gate(min_positions=900).decide(run.broken, run.base)[0]
    assert run.train_s < 20


def test_target_weights_are_bit_identical_after_training(run):
    after = run.target.state_dict()
    assert after.keys() == run.weights_before.keys()
    assert all(torch.equal(after[name], before) for name, before in run.weights_before.items())
    assert not any("lora" in name for name, _ in run.target.named_modules())
    trainable = [name for name, p in run.trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and ".layers.0." in name for name in trainable)
    assert len(trainable) == 2 * 7  # A and B on each of the 7 projections of the one private layer
    assert all(p.grad is None for p in run.target.parameters())  # no gradient ever reached the target
    shared = [run.target.model.embed_tokens, run.target.model.norm, run.target.lm_head]
    assert all(not p.requires_grad for module in shared for p in module.parameters())


# ---------------------------------------------------------------- save, load, continue


def test_save_writes_a_peft_adapter_that_reloads_to_the_same_figures(run, tmp_path):
    path = run.trainer.save(tmp_path / "v1")
    assert {"adapter_config.json", "adapter_model.safetensors", METADATA_FILE} <= {p.name for p in path.iterdir()}
    metadata = AdapterDir(path).metadata().to_dict()
    assert metadata["draft_id"] == "early-exit:1" and metadata["target_id"] == "tiny-llama"
    assert metadata["steps"] == STEPS and metadata["settings"]["lr"] == SETTINGS.lr
    assert 0 < metadata["records_used"] <= len(run.train_records)
    assert metadata["tokens_used"] == NEW_TOKENS * metadata["records_used"]
    assert metadata["draft_config"]["num_hidden_layers"] == 1 and metadata["draft_config"]["vocab_size"] == VOCAB

    champion = DraftTrainer(build_early_exit(run.target, 1), LoraSettings(r=4), init_adapter=path)
    assert champion.settings.r == 16  # the adapter's own shape wins
    assert champion.parent_metadata.steps == STEPS
    assert draft_agreement(champion.model, run.holdout) == run.trained
    fresh = DraftTrainer(build_early_exit(run.target, 1), SETTINGS)
    fresh.load(path)
    assert draft_agreement(fresh.model, run.holdout) == run.trained
    with pytest.raises(ValueError, match="does not fit"):
        DraftTrainer(build_early_exit(run.target, 1), LoraSettings(r=4)).load(path)


def test_transformers_load_adapter_serves_it_on_a_plain_draft_and_leaves_the_target_alone(run, tmp_path):
    path = run.trainer.save(tmp_path / "v1")
    probe = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        target_logits = run.target(probe).logits

    draft = build_early_exit(run.target, 1)
    draft.load_adapter(str(path), adapter_name="v1")
    draft.set_adapter("v1")
    figures = draft_agreement(draft, run.holdout)
    assert figures.positions == run.trained.positions
    assert figures.greedy_match == pytest.approx(run.trained.greedy_match, abs=1e-9)
    assert figures.expected_acceptance == pytest.approx(run.trained.expected_acceptance, abs=1e-6)
    with adapters_disabled(draft):
        assert draft_agreement(draft, run.holdout) == run.base
    assert draft_agreement(draft, run.holdout) == figures  # enabled again

    # transformers prints a LOAD REPORT listing the base weights (lm_head included) as MISSING,
    # "newly initialized"; they are not: the shared weights are bit for bit what they were.
    assert all(torch.equal(run.target.state_dict()[name], before) for name, before in run.weights_before.items())
    with torch.no_grad():
        assert torch.equal(run.target(probe).logits, target_logits)
    assert not any("lora" in name for name, _ in run.target.named_modules())

    # Served: still lossless, and it drafts better than the base draft on held-out prompts.
    prompts = [each.prompt_ids for each in run.holdout[:8]]
    adapted = Engine(run.target, draft, k=3, eos_token_id=[])
    base = Engine(run.target, "early-exit:1", k=3, eos_token_id=[])
    rates = {}
    for name, engine in (("adapted", adapted), ("base", base)):
        outputs = [engine.generate(prompt, max_new_tokens=NEW_TOKENS) for prompt in prompts]
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.token_ids == engine.generate(prompt, max_new_tokens=NEW_TOKENS, speculative=False).token_ids
        rates[name] = sum(o.stats.accepted for o in outputs) / sum(o.stats.drafted for o in outputs)
    print(f"\nengine acceptance rate on 8 held-out prompts: base {rates['base']:.3f}, adapted {rates['adapted']:.3f}")
    assert rates["adapted"] > rates["base"] + 0.1
