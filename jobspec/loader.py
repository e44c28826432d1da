"""Loading a job spec: YAML parsed safely, `a.b=value` overrides applied, converted and validated into a
`JobSpec`; every failure is a `JobSpecError` that names the bad key's path (`$.algorithm.lr`).

Validation happens here, once, before any process starts, so a typo (`algorithm.lr: fast`) is reported
at submit time, not as a crash in a trainer.
"""

from __future__ import annotations

import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import yaml

from common.config import MAX_DEPTH, MAX_SPEC_BYTES
from jobspec.spec import JobSpec, JobSpecError


class _SpecLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases (`*name`: a few hundred bytes of nested aliases expand to
    gigabytes, "billion laughs"), nesting deeper than MAX_DEPTH and a key given twice in one mapping,
    each with the line it is on."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a job spec: write the value out", mark
            )
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested too deeply (more than {MAX_DEPTH} levels)", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        # PyYAML keeps the last of two equal keys; in a spec that hides a value the author wrote (often a
        # section pasted twice), so the second one is refused, with both lines.
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                if key_node.value in first:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key_node.value!r} (first on line {first[key_node.value]})",
                        key_node.start_mark,
                    )
                first[key_node.value] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def decode(data: bytes, source: str = "job spec") -> str:
    """Spec bytes as text; not UTF-8 is a one-line JobSpecError naming `source` and the first bad byte's
    offset (from 0), so the user can find it."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JobSpecError(f"{source}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def parse_yaml(text: str | bytes, source: str = "job spec") -> Any:
    """Parse spec (or override) YAML safely: UTF-8 only, at most MAX_SPEC_BYTES, no aliases, at most
    MAX_DEPTH levels; any problem is a JobSpecError that names `source` and, from YAML, the line."""
    if isinstance(text, bytes):
        text = decode(text, source)
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise JobSpecError(f"{source}: over {MAX_SPEC_BYTES} bytes; a job spec is a few kB")
    loader = _SpecLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise JobSpecError(f"{source}: {e}") from None
    except RecursionError:
        raise JobSpecError(f"{source}: nested too deeply") from None
    finally:
        loader.dispose()


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the Struct class or plain type behind `tp` with Annotated and `| None` removed, accepts str)."""
    args = (
        typing.get_args(tp)
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        else (tp,)
    )
    args = tuple(a for a in args if a is not type(None))
    takes_str = str in args
    return (args[0] if len(args) == 1 else None), takes_str


def _takes_str(parts: list[str]) -> bool:
    """Whether the spec field at dotted `parts` is a string field (`name`, `model.path`, ...)."""
    cls: Any = JobSpec
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls, takes_str = _unwrap(hints[part])
        if i == len(parts) - 1:
            return takes_str
    return False


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML, as safely as a spec) to a raw spec dict,
    returning it. A string field keeps the literal text (`name=123` is the name "123"; `null` is
    still null where the field allows it)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JobSpecError(f"override {item!r}: expected dotted.key=value")
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise JobSpecError(f"override {item!r}: $.{'.'.join(parts[: i + 1])} is not a section")
            node = child
        parsed = parse_yaml(value, source=f"override {item!r}: the value is not YAML")
        if parsed is not None and not isinstance(parsed, (str, dict, list)) and _takes_str(parts):
            parsed = value
        node[parts[-1]] = parsed
    return raw


def _nonfinite(value: Any, path: str = "$") -> str | None:
    """The key path of the first float that is not finite (inf, nan: JSON cannot hold them), or of an
    integer beyond 64 bits, in a converted spec's builtins; None if there is none."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 63):
        return path
    if isinstance(value, dict):
        for k, v in value.items():
            if p := _nonfinite(v, f"{path}.{k}"):
                return p
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if p := _nonfinite(v, f"{path}[{i}]"):
                return p
    return None


_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`(?: - at `(?P<at>[^`]+)`)?")
_NESTED = re.compile(r"(?P<msg>.*) - at `(?P<key>\.[^`]+)`(?: - at `(?P<at>[^`]+)`)?", re.S)


def _placement_defaults(raw: Any) -> Any:
    """`placement: colocated` sets `bus.backend: ipc` unless the spec gives a backend (a gloo or nccl one
    given is then refused, at its path)."""
    if not isinstance(raw, dict) or raw.get("placement") != "colocated":
        return raw
    bus = raw.get("bus")
    if bus is None:
        return {**raw, "bus": {"backend": "ipc"}}
    if isinstance(bus, dict) and "backend" not in bus:
        return {**raw, "bus": {**bus, "backend": "ipc"}}
    return raw


def from_dict(raw: Any) -> JobSpec:
    raw = _placement_defaults(raw)
    try:
        # strict=False: YAML 1.1 reads `1e-4` as a string; numeric strings convert, "fast" still fails.
        spec = msgspec.convert(raw if raw is not None else {}, JobSpec, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        if m := _UNKNOWN.fullmatch(msg):  # point at the bad key itself, not its parent
            msg = f"unknown key - at `{m['at'] or '$'}.{m['key']}`"
        elif m := _NESTED.fullmatch(msg):  # a section's own check (`_bad`) names its key
            msg = f"{m['msg']} - at `{m['at'] or '$'}{m['key']}`"  # no `at`: the root's own check
        raise JobSpecError(f"invalid job spec: {msg}") from e
    except RecursionError:
        raise JobSpecError("invalid job spec: nested too deeply") from None
    if at := _nonfinite(msgspec.to_builtins(spec)):
        raise JobSpecError(f"invalid job spec: expected a finite number within 64 bits - at `{at}`")
    return spec


def load(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML job spec, apply overrides, validate; raise JobSpecError with the key path. An empty
    file (no keys, only comments) with no overrides is refused: it is a mistake, not a default job."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise JobSpecError(f"{path}: {e}") from e
    return loads(text, overrides, source=str(path), refuse_empty=True)


def loads(
    text: str | bytes,
    overrides: list[str] | None = None,
    source: str = "job spec",
    refuse_empty: bool = False,
) -> JobSpec:
    """`load` from YAML (or JSON) text, e.g. a spec sent to the control API. `refuse_empty`: text with
    no keys and no overrides is a JobSpecError ("empty spec") instead of the default job."""
    raw = parse_yaml(text, source)
    if raw is None and refuse_empty and not overrides:
        raise JobSpecError(f"{source}: empty spec (no keys): a job spec sets at least its `name:`")
    if raw is not None and not isinstance(raw, dict):
        raise JobSpecError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    return from_dict(apply_overrides(raw or {}, overrides or []))
