"""An offline check of Kubernetes manifests against the API's object
models, as Debian's python3-kubernetes (API 1.22) defines them: every field
must exist where it is written (apiVersion and kind pick the model), have
the model's type, and required fields must be there (the models refuse to
be built without them). What `kubectl apply --dry-run=server` would catch
first, without a cluster."""

import re

from kubernetes.client import models

# Quantities ("4", 8, "2Gi") are strings in the models; the API takes
# numbers too.
_QUANTITY_MAPS = {"limits", "requests", "capacity", "hard"}


def model_for(api_version, kind):
    """The model class of a top-level object, or None."""
    version = api_version.split("/")[-1]
    name = version[0].upper() + version[1:] + kind
    return getattr(models, name, None)


def check_document(doc):
    """Problems of one manifest document (a list of strings naming the path)."""
    if not isinstance(doc, dict):
        return ["a document is not a mapping"]
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    if not api_version or not kind:
        return ["a document lacks apiVersion or kind"]
    cls = model_for(api_version, kind)
    if cls is None:
        return [f"{api_version} {kind}: no such object in the Kubernetes API"]
    name = (doc.get("metadata") or {}).get("name", "?")
    problems = []
    _build(cls, doc, f"{kind}/{name}", problems, None)
    return problems


def _build(type_name_or_cls, value, path, problems, key):
    """Checks `value` against a model type; the built object (or None)."""
    if isinstance(type_name_or_cls, str):
        t = type_name_or_cls
        m = re.fullmatch(r"list\[(.+)\]", t)
        if m:
            if not isinstance(value, list):
                problems.append(f"{path}: a list expected, got {type(value).__name__}")
                return None
            return [_build(m.group(1), v, f"{path}[{i}]", problems, key)
                    for i, v in enumerate(value)]
        m = re.fullmatch(r"dict\((\w+), (.+)\)", t)
        if m:
            if not isinstance(value, dict):
                problems.append(f"{path}: a mapping expected, got {type(value).__name__}")
                return None
            inner = m.group(2)
            if inner == "str" and key in _QUANTITY_MAPS:
                inner = "quantity"
            return {k: _build(inner, v, f"{path}.{k}", problems, k) for k, v in value.items()}
        if t in ("str", "int", "bool", "float", "object", "datetime", "quantity"):
            ok = {"str": lambda v: isinstance(v, str),
                  "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "bool": lambda v: isinstance(v, bool),
                  "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "object": lambda v: True,
                  "datetime": lambda v: v is None or isinstance(v, str),
                  "quantity": lambda v: isinstance(v, (str, int, float))
                  and not isinstance(v, bool)}[t](value)
            if not ok:
                problems.append(f"{path}: {t} expected, got {value!r}")
            return value
        cls = getattr(models, t, None)
        if cls is None:
            problems.append(f"{path}: unknown model {t}")
            return None
    else:
        cls = type_name_or_cls
    if not isinstance(value, dict):
        problems.append(f"{path}: a mapping expected ({cls.__name__}), got {value!r}")
        return None
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    kwargs = {}
    for k, v in value.items():
        attr = by_json.get(k)
        if attr is None:
            problems.append(f"{path}: unknown field {k!r} in {cls.__name__}")
            continue
        kwargs[attr] = _build(cls.openapi_types[attr], v, f"{path}.{k}", problems, k)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        problems.append(f"{path}: {cls.__name__}: {e}")
        return None
