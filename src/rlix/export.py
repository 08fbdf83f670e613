"""`rlix export CHECKPOINT DEST`: a trainer checkpoint as a plain Hugging Face folder (config,
safetensors, tokenizer) that transformers, `rlix serve` and vLLM load.

A checkpoint of the unsharded trainer already holds one (`model/`): it is copied. A sharded
(FSDP) trainer's checkpoint holds its state in `dcp/` (torch.distributed.checkpoint, every
parameter whole across the files of all ranks), and a `model/` only when it was saved right
after a publish; without one the parameters are read from `dcp/` in this one process (no
process group), cast to the run's model dtype and written with save_pretrained, the config
and tokenizer copied from the run's model (`trainer.json` names it; `model` overrides).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from rlix.errors import ConfigError
from rlix.pipeline import checkpoints

#: files of a model folder that the exported one gets from save_pretrained, not by copying
_WRITTEN = ("config.json", "generation_config.json", "model.safetensors.index.json")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


def find_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint, else the newest complete one under it (a
    pipeline's `checkpoint/` folder, or the pipeline's own folder)."""
    if (path / checkpoints.TRAINER_FILE).is_file():
        return path
    for root in (path, path / "checkpoint"):
        found = checkpoints.newest(root)
        if found is not None:
            return found.path
    raise ConfigError(f"{path}: not a trainer checkpoint (no trainer.json) and no complete checkpoint under it")


def export_checkpoint(checkpoint: str | Path, dest: str | Path, model: str | None = None) -> Path:
    """Write `checkpoint`'s model to `dest` (absent or empty) as a Hugging Face folder; returns
    the checkpoint exported."""
    src, out = find_checkpoint(Path(checkpoint).expanduser()), Path(dest).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder; give a new destination")
    hf = src / "model"
    if (hf / "config.json").is_file() and any(f.name.endswith(".safetensors") for f in hf.iterdir()):
        shutil.copytree(hf, out, dirs_exist_ok=True)
        return src
    if not (src / "dcp" / ".metadata").is_file():
        raise ConfigError(f"{src}: holds neither a model/ folder nor a dcp/ checkpoint")
    base = Path(model or json.loads((src / checkpoints.TRAINER_FILE).read_text()).get("model", "")).expanduser()
    if not (base / "config.json").is_file():
        raise ConfigError(f"{src}: the run's model {str(base)!r} is not a model folder (give --model with "
                          f"its config and tokenizer)")
    _from_dcp(src / "dcp", base, out)
    return src


def _from_dcp(dcp_dir: Path, base: Path, out: Path) -> None:
    import torch  # deferred: torch and transformers, for this command only
    import torch.distributed.checkpoint as dcp  # deferred: as above
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # deferred: as above
    from transformers import AutoModelForCausalLM  # deferred: as above

    meta = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    template = {key.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
                for key, m in meta.items() if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not template:
        raise ConfigError(f"{dcp_dir}: no model parameters in this checkpoint")
    with warnings.catch_warnings():  # "assuming ... a single process": as meant here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": template}, checkpoint_id=str(dcp_dir), no_dist=True)
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
    params = dict(hf.named_parameters())
    missing = sorted(set(params) - set(template))
    unexpected = sorted(set(template) - set(params))
    if missing or unexpected:
        raise ConfigError(f"{dcp_dir} does not fit the model {base}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(p.shape) != tuple(template[name].shape):
                raise ConfigError(f"{dcp_dir}: {name} has shape {tuple(template[name].shape)}, the model "
                                  f"{tuple(p.shape)}")
            p.copy_(template[name])
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    for f in base.iterdir():  # the tokenizer and other files that are neither weights nor written above
        if f.is_file() and f.name not in _WRITTEN and not f.name.endswith(_WEIGHTS) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
