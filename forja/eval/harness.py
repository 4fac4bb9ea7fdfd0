"""lm-evaluation-harness adapter: every harness task on a forja run, checkpoint or HF directory.

    forja lm-eval --model forja --model_args run=runs/default --tasks hellaswag
    python -m forja.eval.harness --model forja --model_args run=runs/default --batch_size 32 \\
        --tasks forja_python_mc --include_path tests/data/eval/harness --output_path out/

    import lm_eval, forja.eval.harness
    from forja.eval.harness import ForjaLM
    lm_eval.simple_evaluate(model=ForjaLM(run="runs/default"), tasks=["arc_easy"])
    lm_eval.simple_evaluate(model="forja", model_args="run=runs/default", tasks=["arc_easy"])

model_args: run (required: a run directory, a checkpoint or a Hugging Face directory; or
pretrained=, which also names the folder lm_eval writes under --output_path), device,
batch_size, dtype (float32/bfloat16/float16; default as saved), quantize (none/int8),
max_length (score in windows shorter than the model's max_seq_len), prefix_token_id.

Why `forja lm-eval` (or `python -m forja.eval.harness`) and not plain `lm_eval --model forja`: lm-eval 0.4.13 finds
models only in its registry, which its own `lm_eval.models` package fills; it reads no entry
point group and imports no plugin module (its Registry can hold an EntryPoint, but nothing
ever calls importlib.metadata.entry_points to find one). So this module registers "forja" and
then hands the rest of the command line to lm_eval's own CLI: every lm_eval flag works.

Requests are tokenized as the harness's `hf` model tokenizes them for the Hugging Face export of
the same run, so both give the same scores (tests/integration/test_harness.py): the context's
trailing whitespace moves to the continuation, context + continuation is encoded whole and split
at the context's length, and no token is put before a non-empty context. The prefix token (for
an empty context and a rolling window's start) is where a document starts, as `forja eval` has
it: a forja run's end-of-document token, a Hugging Face directory's BOS (a forja export declares
its EOS as the BOS, so `hf` on the export picks the same), else the EOS.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from forja.checkpoint.export import document_start, load_model_and_tokenizer
from forja.errors import ForjaError
from forja.eval.score import Request, loglikelihoods, score_requests
from forja.generate import SamplingConfig, generate
from forja.models.quantize import cast
from forja.models.quantize import quantize as quantize_model

try:
    # lm_eval.models first: get_model() fills the registry with the built-in models only when
    # it is empty, so registering "forja" before them would hide "hf" and the rest.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry, register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # forja itself never needs lm_eval; only this module does
    raise ForjaError("forja.eval.harness needs lm-evaluation-harness; pip install 'forja[lm_eval]'") from exc

logger = logging.getLogger(__name__)
# Generation options a forja SamplingConfig can honour; any other is refused, not ignored.
_SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}


class ForjaLM(TemplateLM):
    """A forja model behind lm_eval's LM interface (loglikelihood, rolling, generate_until)."""

    def __init__(self, run: str | None = None, device: str | None = None, batch_size: int | str = 16,
                 dtype: str | None = None, quantize: str = "none", max_length: int | None = None,
                 prefix_token_id: int | None = None, max_batch_size: int | None = None,
                 pretrained: str | None = None) -> None:
        super().__init__()
        # pretrained= is the hf model's name for it; lm_eval also names --output_path's folder after it.
        run = run or pretrained
        if not run:
            raise ForjaError("the forja model needs run=DIR (a run directory, checkpoint or Hugging Face "
                             "directory); pass --model_args run=runs/NAME")
        if not Path(run).expanduser().exists():
            raise ForjaError(f"run={run} does not exist; give a run directory, a checkpoint or a Hugging Face "
                             "directory")
        device = _device(device)
        self.source = str(run)
        model, self.tok = load_model_and_tokenizer(run, device=device)
        self.model = model.eval()
        self.model = cast(self.model, dtype)  # its ForjaError names the choices
        self.quantize = quantize
        self.model = quantize_model(self.model, quantize)  # its ForjaError names the choices
        self._device = torch.device(device)
        # "auto" asks HFLM to probe memory; forja has no probe, so it scores 16 at a time.
        self.batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_len = self.model.args.max_seq_len
        if max_length is not None and not 1 <= int(max_length) <= self.max_len:
            raise ForjaError(f"max_length={max_length} must be between 1 and the model's max_seq_len "
                             f"({self.max_len})")
        self.max_len = int(max_length or self.max_len)
        # Where a document starts (a forja run: its EOS; a Hugging Face directory: its BOS, which a
        # forja export declares to be the EOS), else EOS: what HFLM picks on the export.
        bos, eos = self.tok.bos_id, self.tok.eos_id
        start = document_start(run, self.tok)
        self._prefix = int(prefix_token_id) if prefix_token_id is not None else (start if start is not None else eos)
        self._specials = {i for i in (bos, eos, self.tok.pad_id) if i is not None}

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.max_len

    @property
    def max_gen_toks(self) -> int:
        return 256  # HFLM's default, used when a task sets none

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        # As the hf model: the tokenizer.json's post-processor (the BOS some HF tokenizers add) runs
        # unless the harness says not; forja's own tokenizers have none, so this is tok.encode.
        return self.tok.backend.encode(string, add_special_tokens=add_special_tokens is not False).ids

    def get_model_info(self) -> dict[str, Any]:
        """What the results JSON records about the model, to say which weights were scored."""
        return {"forja_source": self.source, "quantize": self.quantize, "max_length": self.max_len,
                "prefix_token_id": self._prefix,
                "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}

    # -- scoring ------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        scored = []
        for _, context, continuation in requests:
            if not 1 <= len(continuation) <= self.max_len:
                raise ForjaError(f"a continuation of {len(continuation)} tokens cannot be scored with max_length "
                                 f"{self.max_len}; it must be 1 to max_length tokens")
            # As HFLM: too long a sequence loses tokens from the left (the context's start).
            tokens = tuple(context + continuation)[-(self.max_len + 1):]
            scored.append(Request(tokens=tokens, n_scored=len(continuation)))
        results = self._score_with_greedy(scored)
        for (key, _, _), answer in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    @torch.no_grad()
    def _score_with_greedy(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        """(summed log-prob, whether each scored token is the argmax) per request."""
        scores = score_requests(self.model, requests, batch_size=self.batch_size, device=self._device,
                                max_len=self.max_len)
        return [(score.logprob, bool(score.greedy)) for score in scores]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's summed log-likelihood, every token scored once, in the harness's own
        windows of max_length predictions (the first starts from the prefix token)."""
        per_doc = []
        for (text,) in [r.args for r in requests]:
            windows = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_len, context_len=1)
            per_doc.append([Request(tokens=tuple(ctx + pred), n_scored=len(pred))
                            for ctx, pred in map(make_disjoint_window, windows)])
        lls = loglikelihoods(self.model, [r for reqs in per_doc for r in reqs], batch_size=self.batch_size)
        totals, start = [], 0
        for request, reqs in zip(requests, per_doc):
            totals.append(sum(lls[start: start + len(reqs)]))
            start += len(reqs)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    # -- generation ---------------------------------------------------------------------------

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """One request at a time (forja's generate takes no padding mask), cut at the first stop
        string or EOS, as HFLM cuts its output."""
        eos = self.tok.decode([self.eot_token_id])
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            cfg = _sampling(kwargs, max_gen_toks, stop=self.eot_token_id)
            if cfg.max_new_tokens >= self.max_len:
                raise ForjaError(f"max_gen_toks={cfg.max_new_tokens} leaves no room for a prompt in max_length "
                                 f"{self.max_len}; ask for fewer tokens in the task's generation_kwargs")
            # As HFLM: the prompt keeps its last max_length - max_gen_toks tokens.
            ids = (self.tok_encode(context) or [self.prefix_token_id])[-(self.max_len - cfg.max_new_tokens):]
            prompt = torch.tensor([ids], device=self._device)
            new = generate(self.model, prompt, cfg)[0, prompt.shape[1]:].tolist()
            new = new[: new.index(self.eot_token_id)] if self.eot_token_id in new else new
            text = postprocess_generated_text(self.tok.decode([t for t in new if t not in self._specials]),
                                              until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


# Once per process: `python -m forja.eval.harness` runs this file as __main__, and a later import of
# forja.eval.harness would register a second, equal class under the same name, which lm_eval refuses.
if "forja" not in model_registry:
    register_model("forja")(ForjaLM)


def _device(asked: str | None) -> str:
    """The device to score on. lm_eval's CLI asks for cuda:0 unless told otherwise, so on a machine
    without CUDA a cuda device falls back to the CPU, as the hf model does."""
    if asked and (not asked.startswith("cuda") or torch.cuda.is_available()):
        return asked
    if asked:
        logger.warning("device %s asked for, but CUDA is not available: scoring on the CPU", asked)
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sampling(kwargs: dict[str, Any], max_gen_toks: int, *, stop: int) -> SamplingConfig:
    """A SamplingConfig from normalized harness gen_kwargs: greedy unless do_sample."""
    unknown = sorted(set(kwargs) - _SAMPLING_KEYS)
    if unknown:
        raise ForjaError(f"generation_kwargs {', '.join(unknown)} are not supported by the forja model; "
                         f"use only {', '.join(sorted(_SAMPLING_KEYS | {'until', 'max_gen_toks'}))}")
    temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
    # Seedless: sampling draws from torch's global generator, which simple_evaluate seeds.
    return SamplingConfig(max_new_tokens=int(max_gen_toks), temperature=temperature, top_k=kwargs.get("top_k"),
                          top_p=kwargs.get("top_p"), stop_token=stop)


# -- command line ----------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """lm_eval's own CLI with "forja" registered: `python -m forja.eval.harness <lm_eval args>`."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    # lm_eval's HarnessCLI reads sys.argv itself (it inserts `run` for the flag-only form).
    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
