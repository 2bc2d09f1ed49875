"""Distilling the target into the draft: LoRA on an early exit or a head, and the draft a spec trains."""
