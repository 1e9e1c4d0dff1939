"""``grpo export RUN_OR_VERSION OUT``: a trained policy as a plain Hugging Face folder that transformers loads as is.

``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load it (chat
template included), for people who never run this project.

RUN_OR_VERSION is a run directory (its newest version under ``weights.dir``, or ``--version N``) or a version
directory (``.../weights/v000012``, exported as it is). Of a run, a version that a learner wrote after another one
took the run over (a learner frozen past its lease, fenced out: learner.fencing) is never chosen: it was never
announced, and no policy of the run descends from it. A version of whole weights is copied; a LoRA version
(learner.lora) is merged into its base (``W + B A · alpha / r``, in float32, then written in ``--dtype``). Either is
checked against its digest first, and a LoRA version against its base's (``base.json``): an adapter merged into
another model would be a model nobody trained. OUT is written under a temporary name and renamed into place, so it
is whole or absent.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from common.cli import EXIT_USAGE

# Files of a version that are the store's, not the model's.
_STORE_FILES = {"digest", "lease_token", "base.json"}


class ExportError(Exception):
    """What makes an export impossible, said in one line."""


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="grpo export",
        description="Write a trained policy as a plain Hugging Face folder that transformers loads as is: whole "
        "weights copied, or a LoRA adapter merged into its base; checked against its digest first.",
    )
    p.add_argument("source", metavar="RUN_OR_VERSION", help="a run directory or a published version's directory")
    p.add_argument("out", metavar="OUT", help="the folder to write (it must not exist yet, or be empty)")
    p.add_argument("--version", type=int, help="with a run directory: this version instead of the newest")
    p.add_argument("--base", default="", help="LoRA: the base model's directory, where it is not the one the "
                   "version names (its digest must still match)")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="LoRA: the merged model's dtype (auto: the base's)")  # fmt: skip
    args = p.parse_args(list(argv))
    try:
        version = locate(Path(args.source), args.version)
        what = export(version, Path(args.out), base=args.base, dtype=args.dtype)
    except ExportError as e:
        print(f"grpo export: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"exported {version} to {args.out} ({what})")
    return 0


def locate(source: Path, version: int | None) -> Path:
    """The version directory that ``source`` names (see the module's docstring)."""
    from common.weights import newest_on_disk, version_dir, version_token
    from learner.fencing import holders_dir, superseded_versions

    if (source / "digest").is_file():
        if version is not None:
            raise ExportError(f"{source} is a version already; --version goes with a run directory")
        return source
    resolved = source / "config.json"
    if not resolved.is_file():
        raise ExportError(f"{source}: neither a run directory (no config.json) nor a published version (no digest)")
    try:
        tree = json.loads(resolved.read_text())
        weights = _under(source, Path(tree["weights"]["dir"]))
        checkpoints = _under(source, Path(tree.get("checkpoint", {}).get("dir") or "checkpoints"))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{resolved}: not a run's resolved config ({e})") from None
    superseded = superseded_versions(checkpoints)  # the holders' markers (learner.fencing)
    chosen = version if version is not None else newest_on_disk(weights, superseded)
    if chosen < 0 or not version_dir(weights, chosen).is_dir():
        raise ExportError(f"{weights}: no version {chosen if version is not None else ''} on disk".replace("  ", " "))
    if version_token(version_dir(weights, chosen)) and not holders_dir(checkpoints).is_dir():
        # Written under a lease, but the holders' markers are not where the config says (a run directory copied
        # without its checkpoints, or exported from elsewhere): a fenced-out learner's version cannot be told apart.
        raise ExportError(f"{holders_dir(checkpoints)} not found: cannot tell whether a learner fenced out of the run "
                          "wrote the newest versions; export from where the run's checkpoint.dir resolves, or give "
                          "a version's directory")  # fmt: skip
    if superseded(version_token(version_dir(weights, chosen)), chosen):
        where = version_dir(weights, chosen)
        raise ExportError(f"{where} was written by a learner after another took the run over (fenced out): not "
                          "the run's policy; give the version's directory to export it anyway")  # fmt: skip
    return version_dir(weights, chosen)


def _under(run: Path, path: Path) -> Path:
    """A directory of the resolved config: absolute, or relative to the run directory where it is there (else to the
    current directory, as the learner resolved it)."""
    return path if path.is_absolute() or not (run / path).is_dir() else run / path


def export(version: Path, out: Path, *, base: str = "", dtype: str = "auto") -> str:
    """Write ``version`` as a loadable folder at ``out``; returns what was done, for the user."""
    from common.weights.adapters import is_adapter_dir

    _check_digest(version)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: give a new folder")
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        what = _merge(version, tmp, base, dtype) if is_adapter_dir(version) else _copy(version, tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return what


def _check_digest(version: Path) -> None:
    from common.weights import WeightsError, digest

    try:
        wanted = (version / "digest").read_text().strip()
        checked, _ = digest(version, wanted.partition(":")[0] or "xxh3-128")
    except (OSError, WeightsError) as e:
        raise ExportError(f"{version}: {e}") from None
    if checked != wanted:
        raise ExportError(f"{version}: its files do not match its digest (torn or altered): not exported")


def _copy(version: Path, tmp: Path) -> str:
    """Whole weights: the version's files as they are (config, safetensors, tokenizer with its chat template)."""
    if not (version / "config.json").is_file():
        raise ExportError(f"{version}: no config.json")
    tmp.mkdir(parents=True)
    for f in sorted(version.iterdir()):
        if f.is_file() and f.name not in _STORE_FILES:
            shutil.copy2(f, tmp / f.name)
    if not (tmp / "tokenizer_config.json").is_file():
        raise ExportError(f"{version}: published without its tokenizer; export a version the learner wrote")
    return "whole weights, copied"


def _merge(version: Path, tmp: Path, base: str, dtype: str) -> str:
    """A LoRA version folded into its base, with the base's tokenizer (its chat template) and generation config."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from common.model.lora import merged, wrap_as
    from common.weights import WeightsError
    from common.weights.adapters import (
        ADAPTER_WEIGHTS,
        base_identity,
        base_mismatch,
        load_adapter,
        read_base,
        read_config,
    )

    recorded = read_base(version)
    path = base or recorded.get("path", "")
    if not path or not Path(path).is_dir():
        raise ExportError(f"{version}: a LoRA adapter whose base {path!r} is not a directory here; give it with --base")
    if problem := base_mismatch(base_identity(path), recorded):
        raise ExportError(f"{version}: {problem}")
    own = getattr(AutoConfig.from_pretrained(path), "dtype", None)  # what the base's config.json says it is
    target = (own if isinstance(own, torch.dtype) else getattr(torch, str(own or "float32"))) if dtype == "auto" else (
        getattr(torch, dtype))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # merged in float32, then cast
    adapted = wrap_as(model, read_config(version))
    try:
        load_adapter(adapted, load_file(str(version / ADAPTER_WEIGHTS)))
    except WeightsError as e:
        raise ExportError(f"{version}: {e}") from None
    plain = merged(adapted).to(target)
    plain.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
    return f"LoRA merged into {path}, {str(target).removeprefix('torch.')}"
