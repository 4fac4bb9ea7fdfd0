"""How one training step runs: the step engine and the bookkeeping it carries. Its floors, lowest first:

    experts.py, mtp.py, attention_logits.py, scaler.py  MoE, multi-token prediction, attention logits, fp16 scale
    engine.py                                           train_step and eval_loss, plain or pipelined
"""
