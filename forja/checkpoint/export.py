"""From a forja run or checkpoint to a model in memory, or to a Hugging Face directory.

    forja export runs/default --hf out/          # newest intact checkpoint of the run
    forja export runs/default/checkpoints/step-00000200 --hf out/

A checkpoint's forja.json records the model's exact arguments, and the run directory
holds the tokenizer, so a checkpoint is loaded without the data or the original config.

Its files are checked first (verify.py): their sizes always, their checksums for an export.
A run directory's newest intact checkpoint is used (a damaged newer one is named in one line
on stderr); a damaged checkpoint given by name stops with one sentence.

Either side may be in an object store (`forja export s3://b/runs/x --hf s3://b/models/x`): a
store's export is written locally first, then uploaded with config.json last, so a directory
transformers can load (it needs config.json) is always whole.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from forja import storage
from forja.checkpoint import remote
from forja.checkpoint.manager import read_meta
from forja.checkpoint.states import ModelState
from forja.checkpoint.trust import refusal_in
from forja.checkpoint.verify import damage, newest_intact
from forja.errors import ForjaError
from forja.models import build_from_args, get_family, save_hf_checkpoint
from forja.models.common.transformer import Transformer
from forja.models.quantize import DTYPES


def _place(src: str | os.PathLike) -> Path | str:
    """A local path as a Path, a store's URL as a str (a Path would fold its "//")."""
    return str(src).rstrip("/") if storage.is_url(src) else Path(src).expanduser()


def _child(path: Path | str, name: str) -> Path | str:
    return storage.join(path, name) if isinstance(path, str) else path / name


def _holds(path: Path | str, name: str) -> bool:
    return storage.exists(storage.join(path, name)) if isinstance(path, str) else (path / name).is_file()


def resolve_checkpoint(src: str | os.PathLike, *, checksums: bool = False) -> tuple[Path | str, Path | str]:
    """(run directory, checkpoint directory) of a run dir (its newest intact checkpoint) or of an
    intact checkpoint; `checksums` checks the bytes of every file too, not only the sizes.
    In a store both are URLs (str); the store must answer (one sentence if not)."""
    path = _place(src)
    if isinstance(path, str):
        storage.check_reachable(path, write=False, what="checkpoint source")
    if _holds(path, "forja.json"):
        if problem := damage(path, checksums=checksums):
            raise ForjaError(f"{path} is damaged ({problem}); give another checkpoint of the run, or the run "
                             "directory to use its newest intact one")
        return (remote.run_of(path) if isinstance(path, str) else path.parent.parent), path
    if _holds(path, "config.toml"):
        pick = newest_intact(_child(path, "checkpoints"), checksums=checksums)
        if pick.path is None and pick.damaged:
            raise ForjaError(f"{pick.none_intact(_child(path, 'checkpoints'))}; resume the run (forja train) to "
                             "write a new one")
        if pick.path is None:
            raise ForjaError(f"run {path} has no complete checkpoint yet; train it first (forja train)")
        if pick.damaged and not (dist.is_initialized() and dist.get_rank() > 0):  # model.init_from: every rank
            print(f"forja: {pick.notice('using')}", file=sys.stderr, flush=True)
        return path, pick.path
    raise ForjaError(f"{path} is neither a forja run directory (with config.toml) nor a checkpoint "
                     "(with forja.json); give runs/NAME or runs/NAME/checkpoints/step-XXXXXXXX")


def is_forja_source(src: str | os.PathLike) -> bool:
    path = _place(src)
    return _holds(path, "forja.json") or _holds(path, "config.toml")


def run_tokenizer(run_dir: Path | str):
    """The tokenizer a run directory keeps (tokenizer.json), on disk or in a store."""
    from forja.data.corpus.tokenizer import load_tokenizer

    if not isinstance(run_dir, str):
        return load_tokenizer(run_dir / "tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return load_tokenizer(remote.local_copy(storage.join(run_dir, "tokenizer.json"), Path(tmp)))
        except FileNotFoundError:
            raise ForjaError(f"run {run_dir} has no tokenizer.json; give a run directory forja train "
                             "wrote") from None


def load_checkpoint_model(src: str | os.PathLike, *, device: str | torch.device = "cpu",
                          checksums: bool = False) -> tuple[Transformer, Path | str]:
    """The model of a checkpoint (unsharded, on one device) and its run directory."""
    run_dir, ckpt = resolve_checkpoint(src, checksums=checksums)
    identity = read_meta(ckpt)["model"]
    spec = get_family(identity["family"])
    model = build_from_args(spec.args_cls(**identity["args"]), device=device, init=False)
    with warnings.catch_warnings():  # DCP warns that one process loads alone: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"model": ModelState(model)}, no_dist=not dist.is_initialized(),
                     **remote.dcp_target(ckpt, write=False))
        except (CheckpointException, OSError, EOFError, pickle.UnpicklingError) as exc:
            if (refusal := refusal_in(exc)) is not None:
                raise refusal from None
            # Damage that the sizes alone do not show (bytes overwritten in place) can surface here.
            raise ForjaError(f"{ckpt} could not be read ({type(exc).__name__}), so it is likely damaged; give "
                             "another checkpoint of the run") from None
    return model, run_dir


def load_model_and_tokenizer(src: str | os.PathLike, *, device: str | torch.device = "cpu"):
    """(model, tokenizer) of a forja run or checkpoint, or of a Hugging Face directory (its
    tokenizer.json with it): what `forja generate` and `forja eval` run on."""
    from forja.data.corpus.tokenizer import load_tokenizer
    from forja.models import load_hf_checkpoint

    if is_forja_source(src):
        model, run_dir = load_checkpoint_model(src, device=device)
        return model, run_tokenizer(run_dir)
    path = Path(src).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        if not (path / "tokenizer.json").is_file():
            raise ForjaError(f"{path} has no tokenizer.json, so text cannot be turned into tokens; "
                             "put the model's tokenizer.json in that directory")
        return load_hf_checkpoint(path, device=device), load_tokenizer(path)
    raise ForjaError(f"{path} is neither a forja run directory (config.toml), a checkpoint (forja.json) "
                     "nor a Hugging Face model directory (config.json); give one of those")


def document_start(src: str | os.PathLike, tok) -> int | None:
    """The token a document follows in what the model was trained on, for the start of a prompt
    or a scored text: a forja run's end-of-document token (its data packs documents, each
    after one; its BOS token is never trained), a Hugging Face model's BOS when it has one
    (a forja export declares its EOS as the BOS: hf_tokenizer_files), else None."""
    if is_forja_source(src):
        return tok.eos_id
    return tok.bos_id


def hf_tokenizer_files(run_dir: Path | str, max_len: int) -> tuple[dict[str, str], dict[str, int]]:
    """tokenizer.json and a tokenizer_config.json that `AutoTokenizer` understands, plus the
    special-token ids for config.json."""
    tok = run_tokenizer(run_dir)
    roles = dict(tok.roles)
    # A forja run's documents each follow the end-of-document token (the data packs them so);
    # its BOS token is never trained. Declared as the BOS, the EOS is what Hugging Face tools
    # put first (lm-evaluation-harness's prefix, generation from an empty prompt), as forja
    # itself does (`document_start`): the export scores and continues text as the run does.
    bos_id = tok.eos_id if tok.eos_id is not None else tok.bos_id
    if "eos" in roles:
        roles["bos"] = roles["eos"]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False, **{f"{r}_token": t for r, t in roles.items()}}
    ids = {f"{r}_token_id": i for r, i in (("bos", bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id))
           if i is not None}
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}, ids


def export_hf(src: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
              dtype: torch.dtype | None = None) -> Path | str:
    to_store = storage.is_url(out)
    if to_store:  # before any work: the store answers, may be written, holds no other export
        out = str(out).rstrip("/")
        storage.check_reachable(out, write=True, what="export directory")
        if storage.exists(out) and not overwrite:
            raise ForjaError(f"{out} already exists and is not empty; choose another directory, or pass "
                             "--overwrite (overwrite=True from Python)")
    model, run_dir = load_checkpoint_model(src, checksums=True)  # an export is kept: check every byte
    files, token_ids = hf_tokenizer_files(run_dir, model.args.max_seq_len)
    if not to_store:
        out = save_hf_checkpoint(model, out, overwrite=overwrite, dtype=dtype, extra_files=files,
                                 config_updates=token_ids)
        _umask_modes(out)
        return out
    with tempfile.TemporaryDirectory(prefix="forja-export-") as tmp:
        local = save_hf_checkpoint(model, Path(tmp) / "hf", dtype=dtype, extra_files=files, config_updates=token_ids)
        _upload_export(local, out)
    return out


def _upload_export(local: Path, out: str) -> None:
    """Upload an export written at `local` to `out`, config.json last; an export already there
    loses its config.json first, so no reader takes half of the old and half of the new."""
    if storage.exists(out):
        marker = storage.join(out, "config.json")
        fs, path = storage.filesystem(marker)
        try:
            storage.retrying(lambda: fs.rm_file(path), what=f"deleting {marker}", url=out)
        except FileNotFoundError:
            pass
        storage.remove_tree(out)
    storage.upload_dir(local, out, last=("config.json",))


def _umask_modes(folder: Path) -> None:
    """Give the export's files the mode any new file gets (0666 less the umask: 0644 usually).
    safetensors creates its files 0600, which hides an export from the rest of a shared
    machine (another user's `transformers`, a web server) for no reason of forja's."""
    umask = os.umask(0)  # reading the umask means setting it; put back at once
    os.umask(umask)
    for file in folder.iterdir():
        if file.is_file() and not file.is_symlink():
            file.chmod(0o666 & ~umask)


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory",
                       description="Write a run's checkpoint as a Hugging Face model directory (config.json, "
                                   "model.safetensors, the tokenizer) that transformers loads (docs/generation.md).")
    p.add_argument("source", help="a run directory (its newest intact checkpoint) or a checkpoint directory")
    p.add_argument("--hf", required=True, metavar="OUT_DIR", help="the Hugging Face directory to write")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="cast the weights (default: as trained, float32)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it holds files")
    p.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype] if args.dtype else None
    out = export_hf(args.source, args.hf, overwrite=args.overwrite, dtype=dtype)
    hint = "" if _installed("transformers") else (
        "; transformers is not installed here (make train leaves it out): pip install -e '.[hf]' in forja's clone")
    print(f"forja: wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained{hint})")
    return 0


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: an import of it would fail
        return False
