"""The launch line in Hydra's own grammar: the overrides the guard adds, and the user's it reads.

verl reads its command line through Hydra, so every value the guard writes (a checkpoint path with a
space, a comma or a non-ASCII letter; a list of loggers) is written with Hydra's own escaping
(``QuotedString.with_quotes``) where it does not read back as itself unquoted, and is read back
through Hydra's override parser before it is used: a value that would reach verl changed is refused,
never launched. The user's overrides are read by the same parser, as verl reads them.
"""

from __future__ import annotations

from typing import Optional, Sequence, cast

from verl_lrstab.guard.errors import GuardError

_parser = None


def _parse(override: str):
    global _parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if _parser is None:
        _parser = OverridesParser.create()
    return _parser.parse_overrides([override])[0]


def read_back(override: str):
    """The value verl's config gets from ``override`` (Hydra's parser, then OmegaConf's interpolation)."""
    from omegaconf import OmegaConf

    value = _parse(override).value()
    # a DictConfig's container is a dict (to_container is typed for every kind of config)
    return cast(dict, OmegaConf.to_container(OmegaConf.create({"v": value}), resolve=True))["v"]


def _element(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    try:
        if read_back(f"k={text}") == text:
            return text
    except Exception:  # noqa: BLE001 - Hydra's lexer and OmegaConf raise their own kinds
        pass
    from hydra.core.override_parser.types import Quote, QuotedString

    return QuotedString(text=text, quote=Quote.single).with_quotes()


def override(key: str, value) -> str:
    """``key=value`` with ``value`` (a string, number, bool or list of them) in Hydra's grammar, checked
    to read back as ``value``; :class:`~.errors.GuardError` naming the key when it cannot be written so."""
    text = "[" + ",".join(_element(v) for v in value) + "]" if isinstance(value, (list, tuple)) else _element(value)
    line = f"{key}={text}"
    want = list(value) if isinstance(value, tuple) else value
    try:
        back = read_back(line)
    except Exception as err:  # noqa: BLE001
        back = f"an error ({type(err).__name__})"
    if back != want:
        raise GuardError(f"{key.lstrip('+')}: the value {value!r} cannot be passed to verl through Hydra unchanged "
                         f"(it reads back as {back!r}); a path with '${{' cannot be named on verl's command line")
    return line


def key_of(override: str) -> str:
    """The config key an override sets (``++a.b=1`` -> ``a.b``; ``~a.b`` -> ``a.b``)."""
    return override.split("=", 1)[0].lstrip("+~")


def user_value(overrides: Sequence[str], key: str) -> Optional[str]:
    """The value the user's last override of ``key`` gives it, as verl reads it (quotes and escapes
    undone), or None when none sets it. An override Hydra cannot parse was refused before."""
    for o in reversed(list(overrides)):
        if "=" in o and key_of(o) == key:
            try:
                value = read_back(o)
            except Exception:  # noqa: BLE001
                return o.split("=", 1)[1]
            return None if value is None else str(value)
    return None


def rejected_override(overrides: Sequence[str], error: Exception) -> str:
    """The override of ``overrides`` that Hydra's ``error`` is about: the first one its parser
    refuses, else the one whose key the message names, else all of them."""
    for o in overrides:
        try:
            _parse(o)
        except Exception:  # noqa: BLE001
            return o
    message = str(error)
    named = [o for o in overrides if f"'{key_of(o)}'" in message]
    return named[-1] if named else " ".join(overrides)
