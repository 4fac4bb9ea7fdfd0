"""Downstream evaluation: multiple-choice accuracy and perplexity on local JSONL task files.

    from forja.eval import load_task, evaluate
    task = load_task("python_mc")                     # a file, or a name (forja/eval/tasks.py)
    evaluate(model, tokenizer, task, prefix_id=tokenizer.eos_id)   # {"task", "kind", "n", "acc", ...}

`forja eval` (forja/eval/cli.py) drives it from the command line; docs/evaluation.md has the
task format and how each figure is computed.
"""

from forja.eval.score import (
    Request,
    Score,
    choice_requests,
    evaluate,
    evaluate_multiple_choice,
    evaluate_perplexity,
    loglikelihoods,
    score_requests,
    text_requests,
)
from forja.eval.tasks import Choice, Task, Text, load_task

__all__ = ["Choice", "Request", "Score", "Task", "Text", "choice_requests", "evaluate", "evaluate_multiple_choice",
           "evaluate_perplexity", "load_task", "loglikelihoods", "score_requests", "text_requests"]
