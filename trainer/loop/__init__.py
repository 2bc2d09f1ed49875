"""The online loop: `OnlineTrainer` (poll, round, checkpoint), its rounds, lineages and checkpoints."""
