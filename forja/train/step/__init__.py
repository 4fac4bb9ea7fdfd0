"""How one training step runs: the step engine and the bookkeeping it carries. Its floors, lowest first:

    experts.py, mtp.py, attention_logits.py, scaler.py  MoE, multi-token prediction, attention logits, fp16 scale
    groups.py, rerun.py                                 replica groups' interface; a sampled step run again
    engine.py, pipelined.py, build.py                   train_step and eval_loss, plain or pipelined; the choice
"""
