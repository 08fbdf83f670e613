"""The field reference of docs/CONFIG.md, generated from the config models (their types, defaults,
bounds and descriptions): the models are the only source, so a field added there is documented
by running

    python -m rlix.config.docs          # rewrite the reference in docs/CONFIG.md
    python -m rlix.config.docs --check  # exit 1 when the file is not current (what a test runs)

Only the part between the markers is written; the rest of the file is prose kept by hand.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlix.config.models import RlixConfig

BEGIN = "<!-- BEGIN GENERATED: config reference (python -m rlix.config.docs; do not edit by hand) -->"
END = "<!-- END GENERATED: config reference -->"
#: docs/CONFIG.md from a source checkout (src/rlix/config/docs.py -> the repository root)
DOC_PATH = Path(__file__).resolve().parents[3] / "docs" / "CONFIG.md"


def _type(annotation: object) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin is typing.Union or origin is types.UnionType:
        return " \\| ".join("null" if a is type(None) else _type(a) for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"mapping of {_type(args[0])} to {_type(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(json.dumps(m.value) for m in annotation)
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type):
        return {"str": "string", "bool": "boolean", "int": "integer", "float": "number"}.get(
            annotation.__name__, annotation.__name__)
    return str(annotation)


def _metadata(annotation: object) -> list[object]:
    """Constraints carried by the annotation itself (`Annotated[int, Field(ge=1)]`), also
    inside an optional or a list item."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        found: list[object] = []
        for extra in args[1:]:
            found += extra.metadata if isinstance(extra, FieldInfo) else [extra]
        return found + _metadata(args[0])
    if origin is typing.Union or origin is types.UnionType:
        return [m for a in args for m in _metadata(a)]
    return []


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e5:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounds(field: FieldInfo) -> str:
    low = high = ""
    parts = []
    for m in [*field.metadata, *_metadata(field.annotation)]:
        if isinstance(m, at.Ge):
            low = f">= {_number(m.ge)}"
        elif isinstance(m, at.Gt):
            low = f"> {_number(m.gt)}"
        elif isinstance(m, at.Le):
            high = f"<= {_number(m.le)}"
        elif isinstance(m, at.Lt):
            high = f"< {_number(m.lt)}"
        elif isinstance(m, at.MinLen):
            parts.append(f"length >= {m.min_length}")
        elif isinstance(m, at.MaxLen):
            parts.append(f"length <= {m.max_length}")
        elif type(m).__name__ == "_PydanticGeneralMetadata" and "pattern" in m.__dict__:
            parts.append(f"matches `{m.__dict__['pattern']}`")
    return ", ".join([p for p in (low, high) if p] + parts)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(its fields' defaults)"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{json.dumps(value)}`"


def _model_of(annotation: object) -> tuple[type[BaseModel] | None, bool]:
    """The section a field holds (a model, optional or in a list) and whether it is a list."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _model_of(args[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if origin is list:
        return _model_of(args[0])[0], True
    if origin is typing.Union or origin is types.UnionType:
        for a in args:
            found = _model_of(a)
            if found[0] is not None:
                return found
    return None, False


def _describe(field: FieldInfo, section: type[BaseModel] | None) -> str:
    text = field.description or ""
    if not text and section is not None and section.__doc__:
        text = section.__doc__.strip().split("\n\n")[0]
    return " ".join(text.split()).replace("|", "\\|")


def rows(model: type[BaseModel] = RlixConfig, prefix: str = "") -> Iterator[tuple[str, str, str, str, str]]:
    """(path, type, default, bounds, description) of every field, sections before their fields."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        section, is_list = _model_of(field.annotation)
        kind = _type(field.annotation)
        if section is not None:
            kind = f"{'list of sections' if is_list else kind} ({section.__name__})"
        yield path, kind, _default(field), _bounds(field), _describe(field, section)
        if section is not None:
            yield from rows(section, f"{path}[]." if is_list else f"{path}.")


def reference() -> str:
    """The generated part of docs/CONFIG.md, markers included."""
    lines = [BEGIN, "", "| field | type | default | bounds | description |", "| --- | --- | --- | --- | --- |"]
    for path, kind, default, bounds, text in rows():
        lines.append(f"| `{path}` | {kind} | {default} | {bounds} | {text} |")
    return "\n".join(lines + ["", END])


def render(current: str) -> str:
    """`current` with its generated part replaced (appended, with a heading, if it has none)."""
    if BEGIN in current and END in current:
        head, _, rest = current.partition(BEGIN)
        _, _, tail = rest.partition(END)
        return head + reference() + tail
    return current.rstrip("\n") + "\n\n## Every field\n\n" + reference() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlix.config.docs", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not current; write nothing")
    ap.add_argument("--path", default=str(DOC_PATH), help="the file (default: docs/CONFIG.md)")
    args = ap.parse_args(argv)
    path = Path(args.path)
    current = path.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print(f"{path} is not current: run python -m rlix.config.docs", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        path.write_text(wanted)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
