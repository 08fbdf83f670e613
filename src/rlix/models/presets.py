"""Model presets: random-initialised Qwen2 shapes, as transformers checkpoint folders.

A preset is built once (fixed seed, so every machine builds the same weights) into the rlix
cache dir and reused. A "file" preset's folder is a plain `save_pretrained` checkpoint, so the
same files serve on the embedded engine and on vLLM. A "seeded" preset's folder holds the config,
tokenizer and a recipe (`rlix_init.json`) but no weights: writing and reading 15-30 GB of random
numbers costs more than drawing them again, so every process materialises them where it needs
them (models/init.py), bit-identically. `resolve_model` also accepts any local checkpoint
directory. There is no hub download: anything else is a ConfigError.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from rlix import env
from rlix.errors import ConfigError

# Bump when a preset's recipe changes, so stale cached builds are not reused.
RECIPE_VERSION = 2  # 2: the chat template renders tools
#: the version of models/init.py's drawing of a seeded preset's weights (in its folder's name and
#: recipe: a folder names the values it stands for, and a loader refuses a recipe it cannot draw)
SEEDED_RECIPE = 1
SEED = 1234
#: what marks a seeded folder (models/init.py reads it)
SEEDED_FILE = "rlix_init.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: rows per generator: small enough that a rank's slice draws little beyond its rows, large
#: enough that seeding a generator costs nothing beside the draw
BLOCK_ROWS = 64


@dataclass(frozen=True)
class InitRecipe:
    """What a seeded folder's `rlix_init.json` holds: everything its weights depend on besides
    the shapes (models/init.py draws them)."""

    preset: str
    seed: int
    initializer_range: float
    recipe: int = SEEDED_RECIPE
    block_rows: int = BLOCK_ROWS

    @classmethod
    def read(cls, folder: Path) -> InitRecipe:
        try:
            data = json.loads((folder / SEEDED_FILE).read_text())
            recipe = cls(preset=str(data["preset"]), seed=int(data["seed"]),
                         initializer_range=float(data["initializer_range"]), recipe=int(data["recipe"]),
                         block_rows=int(data["block_rows"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{folder / SEEDED_FILE} is not a seeded preset's recipe: {exc}") from None
        if recipe.recipe != SEEDED_RECIPE:
            raise ConfigError(f"{folder} was written for seeded recipe {recipe.recipe}; this rlix draws "
                              f"recipe {SEEDED_RECIPE} (build the preset again)")
        if recipe.block_rows < 1:
            raise ConfigError(f"{folder / SEEDED_FILE}: block_rows must be >= 1")
        return recipe

    def write(self, folder: Path) -> None:
        (folder / SEEDED_FILE).write_text(json.dumps(asdict(self), indent=2))


@dataclass(frozen=True)
class Preset:
    """A Qwen2 shape. head_dim = hidden / heads: 64 (128 for the 1.5B shape, as the real model);
    never 16, which vLLM's CPU attention kernels refuse.

    `weights`: "file" saves the weights in the folder; "seeded" saves only the recipe, and each
    process draws the weights where it loads them (models/init.py): for the large shapes, whose
    files would take longer to write and read than to draw. vLLM cannot load a seeded folder."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # the dtype saved on disk
    initializer_range: float = 0.02
    why: str = ""
    weights: Literal["file", "seeded"] = "file"

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
    "qwen2.5-7b-shape": Preset(3584, 28, 28, 4, 18944, dtype="bfloat16", weights="seeded",
                               why="GPU training at Qwen2.5-7B's shape (6.5B params: the small "
                                   "vocab drops the real model's 1B of embeddings); seeded"),
    "qwen2.5-14b-shape": Preset(5120, 48, 40, 8, 13824, dtype="bfloat16", weights="seeded",
                                why="GPU training at Qwen2.5-14B's shape (13B params: the small "
                                    "vocab drops the real model's 1.6B of embeddings); seeded"),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def is_seeded(path: str | os.PathLike[str]) -> bool:
    """Whether folder `path` is a seeded preset: its recipe and no weight files (weights on disk,
    such as a trainer checkpoint's, always win)."""
    folder = Path(path)
    if not (folder / SEEDED_FILE).is_file():
        return False
    return not any(f.name.endswith(_WEIGHT_SUFFIXES) for f in folder.iterdir())


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")
    return PRESETS[name]


def preset_config(name: str, vocab_size: int, eos_token_id: int, pad_token_id: int):  # type: ignore[no-untyped-def]
    """The transformers Qwen2Config of preset `name` (no weights)."""
    return shape_config(_preset(name), vocab_size, eos_token_id, pad_token_id)


def shape_config(preset: Preset, vocab_size: int, eos_token_id: int, pad_token_id: int):  # type: ignore[no-untyped-def]
    """The transformers Qwen2Config of a preset's shape."""
    from transformers import Qwen2Config  # deferred: `rlix check` resolves presets without torch

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


def build_preset(name: str, dest: Path, preset: Preset | None = None) -> Path:
    """Build preset `name` into `dest` (created; must not hold a checkpoint yet) and return it.
    `preset` builds that shape under `name` instead of PRESETS[name] (tests' own shapes)."""
    import torch  # deferred: only building a preset needs torch (`rlix check` resolves without it)
    from transformers import AutoModelForCausalLM, GenerationConfig  # deferred: as torch

    from rlix.models.tokenizer import ENDOFTEXT, IM_END, build_tokenizer  # deferred: imports transformers

    preset = preset or _preset(name)
    tokenizer = build_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    config = shape_config(preset, len(tokenizer), eos_ids[0], tokenizer.pad_token_id)
    dtype = getattr(torch, preset.dtype)
    generation = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=None, do_sample=False)
    dest.mkdir(parents=True, exist_ok=True)
    if preset.weights == "seeded":
        config.dtype = dtype  # the dtype the weights are drawn in, as a checkpoint's saved one
        config.save_pretrained(dest)
        generation.save_pretrained(dest)
        InitRecipe(name, SEED, preset.initializer_range).write(dest)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(dtype)
        model.generation_config = generation
        model.save_pretrained(dest)
        (dest / "rlix_preset.json").write_text(json.dumps(
            {"preset": name, "recipe_version": RECIPE_VERSION, "seed": SEED}, indent=2))
    tokenizer.save_pretrained(dest)
    _mark_tokenizer_generic(dest)
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
        seeded = PRESETS[text].weights == "seeded"
        target = root / (f"{text}-r{RECIPE_VERSION}-s{SEEDED_RECIPE}" if seeded else f"{text}-r{RECIPE_VERSION}")
        marker = SEEDED_FILE if seeded else "rlix_preset.json"
        if (target / "config.json").is_file() and (target / marker).is_file():
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
