"""How one training step runs: the step engine and the bookkeeping it carries (MoE, attention logits, fp16 scale)."""
