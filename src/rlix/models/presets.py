"""Model presets: random-initialised Qwen2 shapes saved as ordinary transformers checkpoints.

A preset is built once (fixed seed, so every machine builds the same weights) into the rlix
cache dir and reused; the directory is a plain `save_pretrained` checkpoint, so the same files
serve on the embedded engine and on vLLM. `resolve_model` also accepts any local checkpoint
directory. There is no hub download: anything else is a ConfigError.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlix import env
from rlix.errors import ConfigError

# Bump when a preset's recipe changes, so stale cached builds are not reused.
RECIPE_VERSION = 2  # 2: the chat template renders tools
SEED = 1234


@dataclass(frozen=True)
class Preset:
    """A Qwen2 shape. head_dim = hidden / heads: 64 (128 for the 1.5B shape, as the real model);
    never 16, which vLLM's CPU attention kernels refuse."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # the dtype saved on disk
    initializer_range: float = 0.02
    why: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, Preset] = {
    "tiny": Preset(256, 2, 4, 2, 512, initializer_range=0.1,
                   why="tests and CPU examples: a few MB, loads in well under a second"),
    "small": Preset(512, 8, 8, 2, 1536,
                    why="CPU engine benchmark: ~24M params, big enough that matmuls, not "
                        "per-step Python overhead, dominate a decode step"),
    "qwen2-0.5b-shape": Preset(896, 24, 14, 2, 4864, dtype="bfloat16",
                               why="GPU benchmark: Qwen2-0.5B's shape (0.36B with the small vocab)"),
    "qwen2-1.5b-shape": Preset(1536, 28, 12, 2, 8960, dtype="bfloat16",
                               why="GPU benchmark: Qwen2-1.5B's shape"),
    "qwen2.5-3b-shape": Preset(2048, 36, 16, 2, 11008, dtype="bfloat16",
                               why="GPU benchmark: Qwen2.5-3B's shape, where weight sync moves ~5.5 GB"),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_config(name: str, vocab_size: int, eos_token_id: int, pad_token_id: int):  # type: ignore[no-untyped-def]
    """The transformers Qwen2Config of preset `name` (no weights)."""
    from transformers import Qwen2Config  # deferred: `rlix check` resolves presets without torch

    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")
    preset = PRESETS[name]
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        intermediate_size=preset.intermediate_size,
        max_position_embeddings=preset.max_position_embeddings,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        initializer_range=preset.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def build_preset(name: str, dest: Path) -> Path:
    """Build preset `name` into `dest` (created; must not hold a checkpoint yet) and return it."""
    import torch  # deferred: only building a preset needs torch (`rlix check` resolves without it)
    from transformers import AutoModelForCausalLM, GenerationConfig  # deferred: as torch

    from rlix.models.tokenizer import ENDOFTEXT, IM_END, build_tokenizer  # deferred: imports transformers

    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")
    preset = PRESETS[name]
    tokenizer = build_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    config = preset_config(name, len(tokenizer), eos_ids[0], tokenizer.pad_token_id)
    dtype = getattr(torch, preset.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        do_sample=False,
    )
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    _mark_tokenizer_generic(dest)
    (dest / "rlix_preset.json").write_text(json.dumps(
        {"preset": name, "recipe_version": RECIPE_VERSION, "seed": SEED}, indent=2))
    return dest


def _mark_tokenizer_generic(dest: Path) -> None:
    """Name the generic fast-tokenizer class, which every transformers 4.x/5.x (and vLLM) loads."""
    path = dest / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2))


def resolve_model(name_or_path: str | os.PathLike[str], cache_dir: Path | None = None) -> Path:
    """Return a local checkpoint directory: a preset (built into the cache once) or a path."""
    text = os.fspath(name_or_path)
    if text in PRESETS:
        root = (cache_dir or env.cache_dir()) / "models"
        target = root / f"{text}-r{RECIPE_VERSION}"
        if (target / "config.json").is_file() and (target / "rlix_preset.json").is_file():
            return target
        root.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent builders never see a half-written dir.
        staging = Path(tempfile.mkdtemp(prefix=f".{text}-", dir=root))
        try:
            build_preset(text, staging)
            staging.chmod(0o755)
            try:
                staging.rename(target)
            except OSError:  # another process finished first; its build is identical
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target
    path = Path(text).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ConfigError(
        f"model {text!r} is neither a preset ({', '.join(preset_names())}) nor a local "
        "transformers checkpoint directory (with a config.json); rlix downloads nothing")
