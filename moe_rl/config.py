"""Config plumbing shared by every component: a strict pydantic base model, TOML composition with ``@``,
dotted command-line overrides, and validation errors that name the field, the value and the rule.

Precedence (lowest first): model defaults < TOML files given as ``@ file.toml`` (several allowed, deep-merged
left to right) < dotted flags such as ``--orchestrator.max-off-policy-steps 2`` (kebab or snake case).
This is the convention of prime-rl's configs (``uv run rl @ x.toml --a.b value``).

Each component owns its config model (``moe_rl.models.GlmMoeConfig``, ``moe_rl.rl.OrchestratorConfig``,
...); recipes only compose them.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

__all__ = ["BaseConfig", "ConfigError", "parse_cli_args", "load_config", "deep_merge", "error_rule", "format_validation_error",
           "field_docs", "describe_config"]

C = TypeVar("C", bound="BaseConfig")


def _is_number(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    if get_origin(annotation) in (Union, UnionType):
        args = set(get_args(annotation)) - {type(None)}
        return bool(args) and args <= {int, float}
    return False


class BaseConfig(BaseModel):
    """Strict config base: unknown keys are errors, values are validated on assignment too, and a boolean is
    never silently read as a number (``--max-steps`` given without a value parses as ``true``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            if _is_number(cls.model_fields[info.field_name].annotation):
                raise ValueError(
                    f"expects a number, got the boolean {str(value).lower()} (did a flag miss its value?)"
                )
        return value


class ConfigError(ValueError):
    """A config could not be read or failed validation. The message names every bad field, its value
    and the rule it broke."""


def deep_merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``new`` into a copy of ``base``. Tables merge; any other value (lists included)
    replaces the old one wholesale."""
    out = dict(base)
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_value(text: str) -> Any:
    """Parse a command-line value: JSON/TOML literals (ints, floats, true/false, lists) or a plain string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p.replace("-", "_") for p in dotted.split(".")]
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override --{dotted}: '{part}' is a value, not a table, so it has no sub-field")
        node = child
    node[parts[-1]] = value


def parse_cli_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Turn ``["@", "a.toml", "--x.y", "3", "--flag"]`` into a merged dict of values.

    Returns:
        (values, files): the merged tree (files first, then flags) and the TOML files read.

    Raises:
        ConfigError: a file is missing or not valid TOML, a flag has no name, or a token is unexpected.
    """
    files: list[str] = []
    file_tree: dict[str, Any] = {}
    flag_tree: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "@" or tok.startswith("@"):
            path = tok[1:] if tok != "@" else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if tok != "@" else 2
            if not path:
                raise ConfigError("'@' must be followed by a TOML file path, e.g. '@ recipes/debug_cpu/rl.toml'")
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file '{path}' does not exist (given after '@')")
            try:
                data = tomllib.loads(p.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file '{path}' is not valid TOML: {exc}") from exc
            files.append(str(p))
            file_tree = deep_merge(file_tree, data)
            continue
        if tok.startswith("--"):
            name = tok[2:]
            if not name:
                raise ConfigError("found a bare '--' with no field name")
            if "=" in name:
                name, raw = name.split("=", 1)
                i += 1
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "@":
                raw = argv[i + 1]
                i += 2
            else:  # boolean switch: --foo means true, --no-foo means false
                if name.startswith("no-"):
                    name, raw = name[3:], "false"
                else:
                    raw = "true"
                i += 1
            _set_dotted(flag_tree, name, _parse_value(raw))
            continue
        raise ConfigError(f"unexpected argument '{tok}': use '@ file.toml' or '--field.path value'")
    return deep_merge(file_tree, flag_tree), files


def error_rule(err: dict[str, Any]) -> str:
    """The ``" (rule: k=v, ...)"`` suffix of one pydantic error (its context, e.g. ``expected='dense' or 'torch'``),
    or ``""`` when the error carries none; every config error message ends with it."""
    ctx = err.get("ctx") or {}
    rule = ", ".join(f"{k}={v}" for k, v in ctx.items() if k != "error")
    return f" (rule: {rule})" if rule else ""


def format_validation_error(exc: ValidationError, values: dict[str, Any] | None = None) -> str:
    """Render a pydantic error as one line per bad field: ``field = value: rule``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        value = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        rule = error_rule(err)
        if err["type"] == "missing":
            lines.append(f"  {loc}: required field is missing")
        elif isinstance(value, dict):  # a cross-field rule of a section: the message names the fields
            lines.append(f"  {loc + ': ' if loc else ''}{msg}{rule}")
        else:
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            lines.append(f"  {loc} = {shown}: {msg}{rule}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(cls: type[C], argv: list[str] | None = None, **overrides: Any) -> C:
    """Build and validate a config model from CLI-style arguments plus keyword overrides.

    Args:
        cls: the config model.
        argv: tokens such as ``["@", "rl.toml", "--max-steps", "5"]``.
        overrides: top-level values applied last (e.g. ``output_dir=...``).

    Raises:
        ConfigError: on any unreadable file or invalid value (the message lists every bad field).
    """
    values, _ = parse_cli_args(argv or [])
    values = deep_merge(values, {k: v for k, v in overrides.items() if v is not None})
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, values)) from None


def field_docs(cls: type[BaseModel]) -> dict[str, str]:
    """The documentation of each field of ``cls``: its attribute docstring (the string literal right below the
    field, this project's convention) or its ``Field(description=...)``; fields without either are absent.
    Inherited fields are included (a subclass's docstring wins). Reads the classes' source; a class whose source
    is unavailable contributes only descriptions."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass in (BaseModel, BaseConfig):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    for name, info in cls.model_fields.items():
        if info.description:
            docs[name] = info.description
    return docs


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    text = str(annotation).replace("typing.", "").replace("pathlib.", "")
    for mod in ("moe_rl.", "pydantic."):
        while mod in text:  # drop module paths: moe_rl.x.y.Name -> Name
            start = text.index(mod)
            end = start
            while end < len(text) and (text[end].isalnum() or text[end] in "._"):
                end += 1
            text = text[:start] + text[start:end].rsplit(".", 1)[-1] + text[end:]
    return text


def _config_classes(annotation: Any) -> list[type[BaseConfig]]:
    """The ``BaseConfig`` classes a field holds (one, or the members of a union); [] for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseConfig):
        return [annotation]
    if get_origin(annotation) in (Union, UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if members and all(isinstance(a, type) and issubclass(a, BaseConfig) for a in members):
            return members
    return []


def describe_config(cls: type[BaseConfig], section: str | None = None, width: int = 100) -> str:
    """Help text of a config tree: one entry per field, ``name: type = default`` (with its constraints, e.g.
    ``ge=1``) and the field's documentation below it; sub-sections are listed recursively with dotted names.

    Args:
        cls: the root config class (e.g. ``moe_rl.runtime.config.RLConfig``).
        section: a dotted path to one section (``"trainer"``, ``"trainer.optim"``); None: the whole tree.
        width: wrap documentation lines at this many characters.

    Raises:
        ValueError: ``section`` names no section of ``cls`` (the message lists the sections there are).
    """
    import textwrap

    from pydantic_core import PydanticUndefined

    prefix = ""
    inst: Any = None
    if section:
        for part in section.replace("-", "_").split("."):
            info = cls.model_fields.get(part)
            classes = _config_classes(info.annotation) if info is not None else []
            if not classes:
                names = [n for n, f in cls.model_fields.items() if _config_classes(f.annotation)]
                raise ValueError(f"section={section!r}: {cls.__name__} has no section {part!r}; sections: "
                                 f"{', '.join(names) or '(none)'}")
            if inst is not None:
                value = getattr(inst, part)
            elif info.default_factory is not None:
                value = info.default_factory()
            else:
                value = info.default
            cls, prefix = classes[0], f"{prefix}{part}."
            inst = value if isinstance(value, cls) else None
    lines: list[str] = []

    def rule_text(meta: Any) -> str:
        import dataclasses

        if dataclasses.is_dataclass(meta):
            return ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(meta).items() if v is not None)
        return str(meta)

    def walk(klass: type[BaseConfig], pre: str, inst: Any) -> None:
        docs = field_docs(klass)
        for name, info in klass.model_fields.items():
            if inst is not None and isinstance(inst, klass):
                value: Any = getattr(inst, name)
            elif info.default is not PydanticUndefined:
                value = info.default
            elif info.default_factory is not None:
                value = info.default_factory()
            else:
                value = PydanticUndefined
            subs = _config_classes(info.annotation)
            if subs:
                lines.append(f"[{pre}{name}]  {' | '.join(c.__name__ for c in subs)}")
                if docs.get(name):
                    lines.extend(textwrap.wrap(" ".join(docs[name].split()), width, initial_indent="    ",
                                               subsequent_indent="    "))
                for i, sub in enumerate(subs):
                    if i:
                        lines.append(f"[{pre}{name}]  or {sub.__name__}:")
                    walk(sub, f"{pre}{name}.", value if isinstance(value, sub) else None)
                continue
            default = "(required)" if value is PydanticUndefined else repr(value)
            rules = [rule_text(m) for m in info.metadata]
            rule = f"  ({', '.join(rules)})" if rules else ""
            lines.append(f"--{pre}{name}: {_type_name(info.annotation)} = {default}{rule}")
            doc = docs.get(name, "(undocumented)")
            lines.extend(textwrap.wrap(" ".join(doc.split()), width, initial_indent="    ",
                                       subsequent_indent="    "))

    walk(cls, prefix, inst)
    return "\n".join(lines)
