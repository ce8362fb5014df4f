"""The run config's JSON schema -> form fields, and form values <-> the raw YAML mapping.

No field is declared here: every input of the Train tab comes from ``RunConfig.model_json_schema()``
(sections -> groups, enums -> dropdowns, booleans -> checkboxes, numbers -> number boxes, lists and
mixed types -> text), with the field's description as its help text. A field added to the schema
appears in the WebUI without touching this package.

Form values are converted back to a raw mapping that holds only what differs from the defaults, so
the YAML a user previews or saves stays as short as one written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from rlfactory.config.schema import STAGE_SECTIONS, RunConfig
from rlfactory.errors import UserError

# form kinds: bool (checkbox), enum (dropdown), multi (multi-select dropdown), int/float (number box),
# str (text), list (comma-separated text), yaml (text parsed as YAML: dicts and mixed types)
KINDS = ("bool", "enum", "multi", "int", "float", "str", "list", "yaml")
ALWAYS_WRITTEN = ("stage", "output_dir")  # written even at their default: a saved YAML should say them


@dataclass(frozen=True)
class FieldSpec:
    """One input of the form: where it goes in the YAML and how it is edited."""

    path: str  # dotted YAML path, e.g. "train.learning_rate"
    kind: str
    info: str
    default: Any = None  # schema default (None when absent or a default factory)
    choices: tuple[str, ...] = ()
    nullable: bool = False

    @property
    def key(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def section(self) -> str:
        return self.path.split(".")[0] if "." in self.path else ""


@dataclass
class SectionSpec:
    name: str  # "" for the top-level keys
    description: str
    fields: list[FieldSpec] = field(default_factory=list)
    stages: tuple[str, ...] = ()  # stages the section applies to (empty: all)


def _resolve(schema: dict[str, Any], prop: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The non-null alternatives of a property (``$ref`` followed) and whether null is allowed."""
    options = prop.get("anyOf", [prop])
    nullable = any(o.get("type") == "null" for o in options)
    resolved = []
    for option in options:
        if option.get("type") == "null":
            continue
        if "$ref" in option:
            option = schema["$defs"][option["$ref"].rsplit("/", 1)[-1]]
        resolved.append(option)
    return resolved, nullable


def _kind(options: list[dict[str, Any]]) -> tuple[str, tuple[str, ...]]:
    if len(options) != 1:
        return "yaml", ()
    option = options[0]
    if "enum" in option:
        return "enum", tuple(option["enum"])
    kind = option.get("type")
    if kind == "array":
        items = option.get("items", {})
        if "enum" in items:
            return "multi", tuple(items["enum"])
        return ("list", ()) if items.get("type") == "string" else ("yaml", ())
    simple = {"boolean": "bool", "integer": "int", "number": "float", "string": "str"}
    return simple.get(kind, "yaml"), ()


def _bounds(prop: dict[str, Any]) -> str:
    rules = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
    parts = [f"{sign} {prop[key]}" for key, sign in rules.items() if key in prop]
    return f" ({', '.join(parts)})" if parts else ""


def _field(schema: dict[str, Any], path: str, prop: dict[str, Any]) -> FieldSpec:
    options, nullable = _resolve(schema, prop)
    kind, choices = _kind(options)
    info = prop.get("description", "") + _bounds(options[0] if len(options) == 1 else prop)
    # a required choice (stage) starts at its first option rather than at an empty box
    default = prop.get("default", choices[0] if kind == "enum" and not nullable else None)
    return FieldSpec(path, kind, info, default, choices, nullable)


def _is_section(schema: dict[str, Any], prop: dict[str, Any]) -> dict[str, Any] | None:
    options, _ = _resolve(schema, prop)
    if len(options) == 1 and options[0].get("type") == "object" and "properties" in options[0]:
        return options[0]
    return None


def form_sections(schema: dict[str, Any] | None = None) -> list[SectionSpec]:
    """Walk the JSON schema: the top-level keys first, then one SectionSpec per section, in schema order."""
    schema = schema or RunConfig.model_json_schema()
    top = SectionSpec("", schema.get("description", ""))
    sections = [top]
    for name, prop in schema["properties"].items():
        section = _is_section(schema, prop)
        if section is None:
            top.fields.append(_field(schema, name, prop))
            continue
        stages = tuple(s for s, own in STAGE_SECTIONS.items() if name in own)
        spec = SectionSpec(name, section.get("description", ""), stages=stages)
        spec.fields = [_field(schema, f"{name}.{key}", sub) for key, sub in section["properties"].items()]
        sections.append(spec)
    return sections


def all_fields(sections: list[SectionSpec]) -> list[FieldSpec]:
    return [f for s in sections for f in s.fields]


# --------------------------------------------------------------------------- value conversion
def to_form(spec: FieldSpec, value: Any) -> Any:
    """A YAML value -> what the field's widget shows."""
    if spec.kind in ("bool",):
        return bool(value)
    if blank_means_default(spec):
        return "" if value is None else str(value)
    if spec.kind in ("int", "float"):
        return value
    if spec.kind == "multi":
        return [value] if isinstance(value, str) else list(value or [])
    if spec.kind == "list":
        return ", ".join(str(v) for v in ([value] if isinstance(value, str) else value or []))
    if spec.kind == "yaml":
        if value is None or value == {} or value == []:
            return ""
        return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    return "" if value is None else str(value)


def from_form(spec: FieldSpec, value: Any) -> Any:
    """What the widget holds -> a YAML value (None means: leave the key out)."""
    if spec.kind == "bool":
        return bool(value)
    if spec.kind in ("int", "float"):
        if value is None or str(value).strip() == "":
            return None
        try:
            number = float(str(value).strip())
        except ValueError:
            raise UserError(f"{spec.path}: '{value}' is not a number (leave it blank for the default)") from None
        return int(number) if spec.kind == "int" and number.is_integer() else number
    if spec.kind == "multi":
        return list(value or [])
    if spec.kind == "list":
        return [part.strip() for part in str(value or "").split(",") if part.strip()]
    if spec.kind == "yaml":
        text = str(value or "").strip()
        if not text:
            return None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise UserError(f"{spec.path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    text = "" if value is None else str(value)
    return None if text == "" and (spec.nullable or spec.default is None) else text


def blank_means_default(spec: FieldSpec) -> bool:
    """A number whose default is "unset" (max_steps, clip_low, ...): the form shows a text box, blank = unset.
    A Gradio Number cannot stay blank: once its section is opened in the browser it reports 0, and 0 would
    reach the YAML (or fail validation) for a field the user never touched."""
    return spec.kind in ("int", "float") and spec.default is None


def default_form_value(spec: FieldSpec) -> Any:
    return to_form(spec, spec.default)


def _get(raw: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = raw
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set(raw: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def form_to_raw(sections: list[SectionSpec], values: list[Any]) -> dict[str, Any]:
    """Form values (in all_fields order) -> raw mapping with the keys that differ from the defaults.

    ALWAYS_WRITTEN keys are written even at their default; sections of other stages are left out.
    """
    specs = all_fields(sections)
    by_path = dict(zip((s.path for s in specs), values, strict=True))
    stage = by_path.get("stage")
    raw: dict[str, Any] = {}
    for section in sections:
        if section.stages and stage not in section.stages:
            continue
        for spec in section.fields:
            value = from_form(spec, by_path[spec.path])
            if spec.path not in ALWAYS_WRITTEN and (value is None or value == spec.default or value == []):
                continue
            _set(raw, spec.path, value)
    return raw


def form_mapping(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """What Load YAML puts in the form: our mapping as it is, a LLaMA-Factory file converted (docs/MIGRATING.md),
    with a note saying so."""
    from rlfactory.config.llamafactory import convert, is_llamafactory

    if not is_llamafactory(raw):
        return raw, ""
    conversion = convert(raw)
    note = (
        f"; a LLaMA-Factory file: {len(conversion.mapped)} key(s) mapped, {len(conversion.ignored)} ignored "
        f"({'; '.join(conversion.ignored) or 'none'}), see docs/MIGRATING.md"
    )
    return conversion.out, note


def raw_to_form(sections: list[SectionSpec], raw: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """A raw mapping -> form values (defaults where absent), plus the keys the form has no field for."""
    specs = all_fields(sections)
    values = []
    for spec in specs:
        found, value = _get(raw, spec.path)
        values.append(to_form(spec, value) if found else default_form_value(spec))
    known = {s.path for s in specs}
    unknown = [path for path in _leaf_paths(raw) if path not in known]
    return values, unknown


def _leaf_paths(raw: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and not prefix:
            paths += _leaf_paths(value, f"{path}.")
        else:
            paths.append(path)
    return paths


def raw_to_yaml(raw: dict[str, Any]) -> str:
    """The raw mapping as YAML, sections in schema order (what Preview/Save show and Start runs)."""
    return yaml.safe_dump(raw, sort_keys=False, default_flow_style=False, allow_unicode=True)


# Errors that say what is wrong without the key's name: the field they are about.
UNNAMED_ERRORS = (
    ("dataset '", "data.dataset"),
    ("reward function '", "reward.functions"),
)


def error_field(message: str, specs: list[FieldSpec]) -> str | None:
    """The form field an error is about (the earliest key the message names), so the page can show the error next
    to it. A section key is matched as its dotted path (``train.learning_rate``), a top-level key only as the start
    of a clause (``tools: ...``, ``output_dir '...'``): the bare word ``stage`` is prose in most messages."""
    import re

    found: list[tuple[int, str]] = []
    for spec in specs:
        after = r"(?![\w.])" if "." in spec.path else r"(?=:|\s')"
        match = re.search(rf"(?<![\w.]){re.escape(spec.path)}{after}", message)
        if match:
            found.append((match.start(), spec.path))
    found += [(message.find(phrase), path) for phrase, path in UNNAMED_ERRORS if phrase in message]
    return min(found)[1] if found else None
