"""The YAML reader of config files and cost tables: PyYAML's SafeLoader with bounds.

Safe against hostile or broken files, not only against code execution: a file larger than
MAX_FILE_BYTES, nesting deeper than MAX_DEPTH, more than MAX_ALIASES alias uses, aliases that
expand beyond MAX_NODES nodes or MAX_CHARS characters of scalars (an "alias bomb": 676 bytes
that expand to a billion nodes), a recursive alias and a key repeated in one mapping are
refused, naming the line, as one ConfigError of at most rlix.errors.MAX_MESSAGE characters.
Imports nothing of rlix but its errors, so any layer reads files with it (the config, the
scheduler's cost tables).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from rlix.errors import ConfigError, problems_line, short_repr

#: a config file larger than this is refused before it is parsed (real ones are a few KiB)
MAX_FILE_BYTES = 1 << 20
#: collections nested deeper than this are refused (a config nests about 5 deep)
MAX_DEPTH = 64
#: alias uses (`*name`, `<<: *name`) in one file at most
MAX_ALIASES = 256
#: nodes (scalars, lists, mappings) in the document once every alias is expanded, at most
MAX_NODES = 100_000
#: characters of scalars in the document once every alias is expanded, at most
MAX_CHARS = 4 << 20

_MERGE = "tag:yaml.org,2002:merge"


class YamlRefused(yaml.YAMLError):
    """A well-formed YAML file that rlix refuses to expand (too big, too deep, too many or
    recursive aliases); `problem` and `problem_mark` as PyYAML's own errors have them."""

    def __init__(self, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class BoundedSafeLoader(yaml.SafeLoader):
    """SafeLoader with bounds on depth, aliases and expanded size, and no duplicate keys."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self._keys_checked: set[int] = set()

    def compose_node(self, parent: Node | None, index: object) -> Node:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise YamlRefused(f"more than {MAX_ALIASES} aliases (*name)", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlRefused(f"nested more than {MAX_DEPTH} deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Node:
        node = super().compose_document()
        _check_expansion(node)  # before anything is constructed or validated
        return node

    def flatten_mapping(self, node: MappingNode) -> None:
        # a key written twice in one mapping (not one a `<<:` merge brings, which the mapping's
        # own keys override by design); checked once per node, before merging changes it
        if id(node) not in self._keys_checked:
            self._keys_checked.add(id(node))
            seen: dict[object, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: SafeConstructor refuses it with its own message
                    continue
                if first is not None:
                    raise ConstructorError(None, None, f"duplicate key {short_repr(key, 60)} (first on line "
                                                       f"{first}; a key may appear once in a mapping)",
                                           key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        super().flatten_mapping(node)


def _check_expansion(root: Node) -> None:
    """Refuse a node graph whose expansion (every alias replaced by what it names) is larger
    than MAX_NODES nodes or MAX_CHARS scalar characters, or infinite (a recursive alias).
    Linear in the graph's size: each node's expanded size is computed once."""
    size: dict[int, tuple[int, int]] = {}
    open_: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_.discard(key)
            nodes, chars = 1, 0
            for child in _children(node):
                n, c = size[id(child)]
                nodes, chars = nodes + n, chars + c
            if isinstance(node, ScalarNode):
                chars += len(node.value)
            size[key] = (nodes, chars)
            if nodes > MAX_NODES or chars > MAX_CHARS:
                what = f"{MAX_NODES} nodes" if nodes > MAX_NODES else f"{MAX_CHARS} characters"
                raise YamlRefused(f"more than {what} once its aliases are expanded (an alias bomb?)",
                                  node.start_mark)
            continue
        if key in size:
            continue
        if key in open_:
            raise YamlRefused("a recursive alias (a node that contains itself)", node.start_mark)
        open_.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in size)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load_yaml(path: str | Path) -> object:
    """The parsed file (bounded: see the module docstring), or one ConfigError line."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"{p}: no such file")
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{p}: {p.stat().st_size} bytes; a config file may have {MAX_FILE_BYTES} at most")
        return yaml.load(p.read_text(encoding="utf-8"), Loader=BoundedSafeLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except PermissionError:
        raise ConfigError(f"{p}: not readable (permission denied)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        what = "refused" if isinstance(exc, YamlRefused) else "not valid YAML"
        raise ConfigError(problems_line(f"{p}:{where} {what}", [str(getattr(exc, "problem", None) or exc)])) from None
