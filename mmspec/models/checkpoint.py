"""Checks on a saved model folder before any library reads it: the config is a JSON object and
every ``*.safetensors`` file has a readable header covering the whole file.

A loader given a folder without its config (or with a truncated weight file) does not fail
cleanly: transformers falls back to a default config and builds a full-size model. These checks
read only JSON and safetensors headers (no tensor data), so they cost milliseconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_config(file: Path, component: str) -> dict:
    """``file`` parsed as a JSON object; ``FileNotFoundError`` / ``ValueError`` naming the file."""
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{component}: missing {file} (the component's config)")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{component}: {file} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{component}: {file} must hold a JSON object, got {type(config).__name__}")
    return config


def safetensors_numel(file: Path, component: str) -> int:
    """The number of values stored in a safetensors file, read from its header (which
    ``safe_open`` checks against the file's size: a truncated file fails here, naming it)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except Exception as err:  # SafetensorError (corrupt header, truncated data) or OSError
        raise ValueError(f"{component}: {file} is not a readable safetensors file ({err}); "
                         "re-save or re-copy it") from None


def weight_files(folder: Path, component: str) -> list[Path]:
    """The folder's ``*.safetensors`` files (safetensors only: other formats are refused)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f" (found {', '.join(other)}: only safetensors weights are loaded)" if other else ""
        raise FileNotFoundError(f"{component}: no *.safetensors weights in {folder}{found}")
    return files


def check_model_folder(folder, component: str, config_name: str = "config.json") -> tuple[dict, int]:
    """A saved model folder: ``config_name`` holds a JSON object and every safetensors file is
    readable. Returns ``(config, stored values)``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{component}: no such folder {folder}")
    config = read_config(folder / config_name, component)
    return config, sum(safetensors_numel(f, component) for f in weight_files(folder, component))
