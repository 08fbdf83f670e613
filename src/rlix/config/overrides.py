"""`--set path.to.field=value`: one field of a run config changed on the command line, applied to
the YAML's data before validation, so the result is checked (and `rlix check` reports it) as if
the file said so.

A path names fields by their config names, joined by dots; a list element by its index
(`pipelines[0]`, `pipelines.0`) or, for pipelines, by its name (`pipelines.pa`). Each step is
checked against the config models, so a misspelt field is refused naming the path and the
fields it could be. The value is read as YAML (`3`, `0.5`, `true`, `null`, `[a, b]`,
`{k: v}`); `=` inside the value is kept.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Sequence

import yaml
from pydantic import BaseModel

from rlix.errors import ConfigError
from rlix.safe_yaml import BoundedSafeLoader

#: the longest value one --set may carry (a config file may have 1 MiB in all)
MAX_VALUE_CHARS = 64 << 10
_STEP = re.compile(r"([^.\[\]]+)|\[([^\[\]]*)\]")


def parse_path(path: str) -> list[str]:
    """`pipelines[0].rollout.temperature` -> ['pipelines', '0', 'rollout', 'temperature']."""
    steps, at = [], 0
    for m in _STEP.finditer(path):
        gap, name = path[at:m.start()], m.group(1)
        if not ((gap == "" and (at == 0 or name is None)) or (gap == "." and at > 0)):
            raise ValueError("not a field path (fields are joined by '.', list items as [N])")
        steps.append(m.group(1) if m.group(1) is not None else m.group(2).strip())
        at = m.end()
    if not steps or at != len(path) or any(not s for s in steps):
        raise ValueError("not a field path (fields are joined by '.', list items as [N])")
    return steps


def _models_in(annotation: object) -> tuple[type[BaseModel] | None, bool]:
    """The config model a field's annotation holds (itself, in a list, or optional), and
    whether it is a list of them."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if origin is list:
        inner, _ = _models_in(typing.get_args(annotation)[0])
        return inner, True
    if origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(annotation):
            found = _models_in(arg)
            if found[0] is not None:
                return found
    return None, False


def _set(data: dict, steps: list[str], value: object, model: type[BaseModel]) -> None:
    node: object = data
    where: list[str] = []
    current: type[BaseModel] | None = model
    i = 0
    while i < len(steps):
        step, last = steps[i], i == len(steps) - 1
        if current is not None and step not in current.model_fields:
            fields = ", ".join(sorted(current.model_fields))
            raise ValueError(f"{'.'.join(where) or 'the config'} has no field {step!r} (it has: {fields})")
        annotation = current.model_fields[step].annotation if current is not None else None
        inner, is_list = _models_in(annotation) if current is not None else (None, False)
        where.append(step)
        if not isinstance(node, dict):
            raise ValueError(f"{'.'.join(where[:-1])} is not a mapping in the config")
        if last:
            node[step] = value
            return
        if is_list:
            items = node.get(step)
            if not isinstance(items, list):
                raise ValueError(f"{'.'.join(where)} is not a list in the config")
            key = steps[i + 1]
            index = _index(items, key, '.'.join(where))
            where[-1] += f"[{index}]"
            if i + 1 == len(steps) - 1:
                items[index] = value
                return
            node, current, i = items[index], inner, i + 2
            continue
        child = node.get(step)
        if child is None:  # a section the file leaves to its defaults
            child = node[step] = {}
        node, current, i = child, inner, i + 1


def _index(items: list, key: str, where: str) -> int:
    """A list element by its index, or a pipeline by its name."""
    if re.fullmatch(r"-?\d+", key):
        index = int(key)
        if not -len(items) <= index < len(items):
            raise ValueError(f"{where} has {len(items)} item(s); no [{index}]")
        return index % len(items)
    named = [i for i, item in enumerate(items) if isinstance(item, dict) and item.get("name") == key]
    if not named:
        names = [str(item.get("name")) for item in items if isinstance(item, dict) and "name" in item]
        raise ValueError(f"{where} has no item named {key!r}" + (f" (names: {', '.join(names)})" if names else ""))
    return named[0]


def parse_value(text: str) -> object:
    if len(text) > MAX_VALUE_CHARS:
        raise ValueError(f"the value has {len(text)} characters; at most {MAX_VALUE_CHARS}")
    try:
        return yaml.load(text, Loader=BoundedSafeLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        raise ValueError(f"the value is not YAML: {' '.join(str(getattr(exc, 'problem', None) or exc).split())}") \
            from None


def apply_overrides(data: dict, sets: Sequence[str], model: type[BaseModel]) -> dict:
    """`data` (a config's YAML, not yet validated) with each `path=value` of `sets` applied in
    order; one ConfigError line naming the first bad one."""
    for item in sets:
        path, eq, text = item.partition("=")
        try:
            if not eq:
                raise ValueError("expected path.to.field=value")
            _set(data, parse_path(path.strip()), parse_value(text), model)
        except ValueError as exc:
            raise ConfigError(f"--set {item[:200]}: {exc}") from None
    return data


def read_back(cfg: BaseModel, item: str) -> object:
    """The value a validated config holds at an override's path (what `rlix check` reports)."""
    node: object = cfg
    for step in parse_path(item.partition("=")[0].strip()):
        if isinstance(node, BaseModel):
            node = node.__dict__[step]
        elif isinstance(node, list):
            node = node[_index([n.model_dump() if isinstance(n, BaseModel) else n for n in node], step, "")]
        elif isinstance(node, dict):
            node = node[step]
    return node.model_dump(mode="json") if isinstance(node, BaseModel) else node
