"""The online trainer (`adaptive-spec train`): correction records in, promoted adapter versions out.

Six concerns, one subpackage each, imports going down this list only (pyproject.toml checks it):

- process/: the trainer as a long-lived process: its settings, the one builder, the leader lease;
- loop/: `OnlineTrainer`, a short loop over the parts below, its rounds, lineages and checkpoints;
- promotion/: the champion each lineage trains from and gates against, version directories, the
  queue that registers promotions in MLflow through outages;
- learning/: LoRA distillation toward the target's top-m (early exit, head) and the draft to train;
- evaluation/: the held-out figures and the gate's decision;
- intake/: the correction stream's consumer group, training examples, the replay buffer and the
  held-out split.
"""
