"""Job specs from dicts, YAML or JSON into aidn.v1.JobSpec, through
protobuf's JSON mapping as aidnctl reads them (aidnctl/spec_io.h): field
names are those of job.proto, unknown fields are refused, enum names may be
written in any case ("cpu", "ddp"), a Duration may be "5m", "1h30m" or
"250ms" besides protobuf's "10s", and a number written where job.proto has a
string field (name: 123) is taken as its text."""

import os
import re
from typing import Any, Mapping, Union

from google.protobuf import descriptor, json_format

from .v1 import job_pb2

_FD = descriptor.FieldDescriptor
_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                 "h": 3600.0}


def _duration(text: str):
    """"1h30m" → "5400s"; None when `text` is no Go-style duration."""
    body = text.strip()
    sign = ""
    if body[:1] in "+-":
        sign, body = ("-" if body[0] == "-" else ""), body[1:]
    if not body:
        return None
    pos, seconds = 0, 0.0
    while pos < len(body):
        m = _DURATION_PART.match(body, pos)
        if m is None:
            return None
        seconds += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    nanos = round(seconds * 1e9)
    whole, frac = divmod(nanos, 10**9)
    out = str(whole) + (("." + f"{frac:09d}".rstrip("0")) if frac else "")
    return f"{sign}{out}s"


def _where(path: str) -> str:
    return path or "spec"


def _normalize(value: Any, message: descriptor.Descriptor, path: str) -> Any:
    """`value` with enum names upper-cased, durations in protobuf's form and
    numbers in string fields as text, guided by `message`'s fields."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{_where(path)}: expected a mapping, not {type(value).__name__}")
    out = {}
    for key, item in value.items():
        key = str(key)
        field = message.fields_by_name.get(key)
        if field is None:
            field = next((f for f in message.fields if f.json_name == key), None)
        sub = f"{path}.{key}" if path else key
        if field is None or item is None:
            out[key] = item  # protobuf names the unknown field
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if not isinstance(item, Mapping):
                raise ValueError(f"{sub}: expected a mapping")
            out[key] = {str(k): _scalar(v, value_field, f"{sub}[{k!r}]") for k, v in item.items()}
        elif field.label == _FD.LABEL_REPEATED:
            if not isinstance(item, (list, tuple)):
                raise ValueError(f"{sub}: expected a list")
            out[key] = [_scalar(v, field, f"{sub}[{i}]") for i, v in enumerate(item)]
        else:
            out[key] = _scalar(item, field, sub)
    return out


def _scalar(value: Any, field: descriptor.FieldDescriptor, path: str) -> Any:
    if field.type == _FD.TYPE_MESSAGE:
        if field.message_type.full_name == "google.protobuf.Duration":
            if isinstance(value, str):
                return _duration(value) or value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return f"{value}s"
            return value
        return _normalize(value, field.message_type, path)
    if field.type == _FD.TYPE_ENUM and isinstance(value, str):
        return value.upper()
    if field.type == _FD.TYPE_STRING and isinstance(value, (int, float)) \
            and not isinstance(value, bool):
        return str(value)
    return value


def spec_from_dict(spec: Mapping[str, Any]) -> job_pb2.JobSpec:
    """A JobSpec from a dict as job.yaml would hold it. ValueError naming the
    field for anything protobuf's JSON mapping refuses."""
    normalized = _normalize(spec, job_pb2.JobSpec.DESCRIPTOR, "")
    message = job_pb2.JobSpec()
    try:
        json_format.ParseDict(normalized, message)
    except json_format.ParseError as e:
        raise ValueError(f"job spec: {e}") from None
    return message


def parse_spec(text: str, source: str = "<text>") -> job_pb2.JobSpec:
    """JSON if the text starts with '{' (after spaces), YAML otherwise."""
    if text.lstrip().startswith("{"):
        import json
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: line {e.lineno}, column {e.colno}: {e.msg}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{source}: reading YAML needs PyYAML (python3-yaml); "
                             "or give the spec as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{source}: {e}") from None
    if data is None:
        raise ValueError(f"{source}: empty job spec")
    try:
        return spec_from_dict(data)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load_spec(spec: Union[str, os.PathLike, Mapping, job_pb2.JobSpec]) -> job_pb2.JobSpec:
    """A JobSpec from a JobSpec, a dict, or the path of a YAML or JSON file."""
    if isinstance(spec, job_pb2.JobSpec):
        return spec
    if isinstance(spec, Mapping):
        return spec_from_dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        with open(path, encoding="utf-8") as f:
            return parse_spec(f.read(), path)
    raise TypeError(f"a job spec is a dict, a JobSpec or a file path, not {type(spec).__name__}")
