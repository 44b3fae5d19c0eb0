"""Where the Client finds the coordinator and its bearer token: the same
places, in the same order, as aidnctl (aidnctl/config.h).

Each setting comes from the first of these that has it:
  1. the argument (address=, token=, tls_ca=, insecure=);
  2. the environment (AIDN_ADDR, AIDN_TOKEN, AIDN_TLS_CA, AIDN_INSECURE=1; an
     empty variable counts as unset);
  3. the config file, $HOME/.config/aidn/config, YAML with the keys
       addr: coordinator.example.com:7070
       token: 3f9a...            # or:
       token_file: ~/.aidn-token # its contents, trimmed, are the token
       tls_ca: ~/.aidn-ca.pem    # the coordinator's <state-dir>/tls/ca.pem
       insecure: true            # plaintext, to a coordinator run with --insecure
     (a relative token_file or tls_ca is taken relative to the config file's
     directory);
  4. the default address 127.0.0.1:7070, no token, TLS verified with the
     system's roots.
An address without a port gets :7070.
"""

import dataclasses
import os
from typing import Mapping, Optional

DEFAULT_ADDRESS = "127.0.0.1:7070"
DEFAULT_PORT = "7070"
_KEYS = ("addr", "token", "token_file", "tls_ca", "insecure")


@dataclasses.dataclass(frozen=True)
class Connection:
    address: str = DEFAULT_ADDRESS
    token: str = ""
    tls_ca: str = ""
    insecure: bool = False


def default_config_path(environ: Mapping[str, str]) -> str:
    """$HOME/.config/aidn/config, or "" without HOME."""
    home = environ.get("HOME", "")
    return os.path.join(home, ".config", "aidn", "config") if home else ""


def _parse_simple(text: str, path: str) -> dict:
    # Without PyYAML: "key: value" lines, '#' comments, optional quotes.
    config = {}
    for n, line in enumerate(text.splitlines(), start=1):
        stripped = line.split(" #", 1)[0].strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, sep, value = stripped.partition(":")
        if not sep:
            raise ValueError(f"{path}: line {n}: expected \"key: value\"")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if key.strip() in config:
            raise ValueError(f"{path}: line {n}: {key.strip()} is set twice")
        config[key.strip()] = value or None
    return config


def parse_config(text: str, path: str) -> dict:
    """The config file's settings ({} for an empty file). ValueError naming
    the file for a malformed one, an unknown key, or both token and
    token_file."""
    try:
        import yaml
    except ImportError:
        config = _parse_simple(text, path)
    else:
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: {e}") from None
        if config is None:
            config = {}
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a mapping with the keys {', '.join(_KEYS)}")
    for key, value in config.items():
        if key not in _KEYS:
            raise ValueError(f"{path}: unknown key \"{key}\" (known: {', '.join(_KEYS)})")
        if value is not None and not isinstance(value, (str, int, float)):
            raise ValueError(f"{path}: {key} must be a string")
    config = {k: str(v) for k, v in config.items() if v is not None}
    if "token" in config and "token_file" in config:
        raise ValueError(f"{path}: set either token or token_file, not both")
    return config


def _with_default_port(address: str) -> str:
    # Anything with a colon already names a port (host:port, [v6]:port) or a
    # scheme (unix:/path).
    return address if ":" in address else f"{address}:{DEFAULT_PORT}"


def _token_file_path(token_file: str, config_path: str, environ: Mapping[str, str]) -> str:
    if token_file == "~" or token_file.startswith("~/"):
        return environ.get("HOME", "") + token_file[1:]
    if token_file.startswith("/"):
        return token_file
    return os.path.join(os.path.dirname(config_path), token_file)


def resolve(address: Optional[str] = None, token: Optional[str] = None,
            environ: Mapping[str, str] = os.environ,
            config_path: Optional[str] = None, tls_ca: Optional[str] = None,
            insecure: Optional[bool] = None) -> Connection:
    """The connection settings (see the module doc); `config_path` defaults to
    $HOME/.config/aidn/config, which may be missing."""
    if config_path is None:
        config_path = default_config_path(environ)
    config = {}
    if config_path:
        try:
            with open(config_path, encoding="utf-8") as f:
                config = parse_config(f.read(), config_path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ValueError(f"cannot read config file {config_path}: {e.strerror}") from None

    if address is not None:
        if not address:
            raise ValueError("address is empty")
        resolved_address = address
    else:
        resolved_address = (environ.get("AIDN_ADDR") or config.get("addr")
                            or DEFAULT_ADDRESS)

    if token is not None:
        resolved_token = token
    elif environ.get("AIDN_TOKEN"):
        resolved_token = environ["AIDN_TOKEN"]
    elif "token" in config:
        resolved_token = config["token"]
    elif config.get("token_file"):
        path = _token_file_path(config["token_file"], config_path, environ)
        try:
            with open(path, encoding="utf-8") as f:
                resolved_token = f.read().strip()
        except OSError as e:
            raise ValueError(f"{config_path}: token_file: cannot read {path}: "
                             f"{e.strerror}") from None
        if not resolved_token:
            raise ValueError(f"{config_path}: token_file: {path} is empty")
    else:
        resolved_token = ""

    if tls_ca is not None or insecure is not None:
        resolved_ca, resolved_insecure = tls_ca or "", bool(insecure)
    elif environ.get("AIDN_TLS_CA") or environ.get("AIDN_INSECURE"):
        resolved_ca = environ.get("AIDN_TLS_CA", "")
        resolved_insecure = environ.get("AIDN_INSECURE", "") in ("1", "true")
    else:
        resolved_insecure = config.get("insecure", "false").lower() == "true"
        resolved_ca = (_token_file_path(config["tls_ca"], config_path, environ)
                       if config.get("tls_ca") else "")
    if resolved_insecure:
        resolved_ca = ""
    return Connection(_with_default_port(resolved_address), resolved_token, resolved_ca,
                      resolved_insecure)
