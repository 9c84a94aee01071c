"""Draft-head folders: a `config.json` beside one weights file (Medusa heads, block drafters, the EAGLE heads
train-eagle writes). Reading checks the tensors' names and shapes against the head that receives them and names
what is wrong; writing is how every trainer (spec_decode/self_distill.py) ends."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch


def read_config(folder: Path, method: str, what: str) -> dict:
    """The folder's config.json; `what` says what it should hold (for the error when there is none)."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{method}: {folder} has no config.json ({what}).")
    return json.loads(cfg_file.read_text())


def find_weights(folder: Path, names: tuple[str, ...], method: str) -> Path:
    """The first of `names` the folder holds."""
    found = next((folder / n for n in names if (folder / n).is_file()), None)
    if found is None:
        which = f"no {names[0]}" if len(names) == 1 else f"neither {' nor '.join(names)}"
        raise ValueError(f"{method}: {folder} has {which}.")
    return found


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or a .pt state dict (tensors only)."""
    if path.suffix == ".pt":
        return torch.load(path, map_location="cpu", weights_only=True)
    from safetensors.torch import load_file

    return load_file(str(path))


def fill(method: str, source: str, state: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
         shape_note: str = "", shown: Callable[[str], str] = str) -> None:
    """Copy state[name] into each of params (parameters or views of them) after checking that the names match
    both ways and every shape agrees; `shown` gives a name as the checkpoint spells it, `shape_note` follows a
    shape error (what the expected shape comes from)."""
    missing = sorted(set(params) - set(state))
    unused = sorted(set(state) - set(params))
    if missing or unused:
        parts = (missing and f"lacks {', '.join(map(shown, missing[:5]))}",
                 unused and f"has unexpected {', '.join(map(shown, unused[:5]))}")
        raise ValueError(f"{method}: {source} " + "; ".join(p for p in parts if p) + ".")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise ValueError(f"{method}: {shown(name)} is {tuple(state[name].shape)}, expected {tuple(p.shape)}"
                                 f"{shape_note}.")
            p.copy_(state[name])


def write_folder(out: str | Path, weights: str, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """The folder `out` with `weights` (float32 safetensors) and config.json; returns its path."""
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous().clone() for k, v in tensors.items()}, str(folder / weights),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1, default=str))
    return folder
