"""Constraints on JSON strings and numbers as regular expressions over their text, for the
guided-decoding schema subset (producer.grammar.json_schema): a string's `pattern`, `format` or
length, an integer's or number's bounds. The grammar runs each through producer.grammar.regex's
automaton. Plain Python, no dependencies.
"""

from __future__ import annotations

import math
from typing import Any

from producer.grammar.regex import RegexError, compile_regex

STRING_KEYWORDS = {"pattern", "format", "minLength", "maxLength"}
BOUND_KEYWORDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
# A character of a string the grammar writes: anything JSON needs no escape for. Strings
# under a pattern are written without escapes, so their text is their value.
PLAIN_CHAR = r'[^"\\\x00-\x1f]'
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMATS = {  # JSON Schema formats, as regular expressions over the string's text
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "email": r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
}


def string_pattern(schema: dict[str, Any], where: str) -> str | None:
    """The regex a string's whole text must match, from `pattern` (matched anywhere in the
    string unless anchored, as JSON Schema means it), `format`, or `minLength`/`maxLength`
    (in characters); None when the string is free."""
    given = sorted(STRING_KEYWORDS & set(schema))
    if not given:
        return None
    if len(set(given) & {"pattern", "format"}) > 1 or (
            set(given) & {"pattern", "format"} and set(given) & {"minLength", "maxLength"}):
        raise ValueError(f"json_schema: {where}: {' beside '.join(given)} not supported: one of pattern, format, "
                         "or minLength/maxLength")
    if "pattern" in schema:
        content = _search(schema["pattern"], where)
    elif "format" in schema:
        if schema["format"] not in FORMATS:
            raise ValueError(f"json_schema: {where}: format {schema['format']!r} not supported "
                             f"(supported: {', '.join(FORMATS)})")
        content = FORMATS[schema["format"]]
    else:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise ValueError(f"json_schema: {where}: minLength/maxLength must be integers, 0 <= min <= max")
        content = f"{PLAIN_CHAR}{{{low},{'' if high is None else high}}}"
    try:
        compile_regex(content)
    except RegexError as exc:
        raise ValueError(f"json_schema: {where}: {str(exc).removeprefix('regex ')}") from None
    return content


def _bounds(schema: dict[str, Any], where: str) -> list[tuple[str, float]]:
    """(keyword, bound) for each of minimum, maximum and their exclusive forms present."""
    out: list[tuple[str, float]] = []
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key in schema:
            bound = schema[key]
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
                raise ValueError(f"json_schema: {where}: {key} must be a number, got {bound!r}")
            out.append((key, bound))
    return out


def integer_pattern(schema: dict[str, Any], where: str) -> str | None:
    """The regex of an integer's decimal text within its bounds (minimum, maximum and their
    exclusive forms); None when it has none."""
    bounds = _bounds(schema, where)
    if not bounds:
        return None
    lows: list[int] = []
    highs: list[int] = []
    for key, bound in bounds:
        # the integers within a bound: ceil of a lower one, floor of an upper one
        lower = key.endswith("inimum")
        whole = -math.floor(-bound) if lower else math.floor(bound)
        if whole == bound and key.startswith("exclusive"):
            whole += 1 if lower else -1
        (lows if lower else highs).append(int(whole))
    low, high = max(lows) if lows else None, min(highs) if highs else None
    if low is not None and high is not None and low > high:
        raise ValueError(f"json_schema: {where}: no integer lies within the bounds")
    return integer_range_regex(low, high)


def number_pattern(schema: dict[str, Any], where: str) -> str | None:
    """The regex of a number's text (plain decimals, no exponent) within whole-number bounds;
    None without bounds."""
    bounds = _bounds(schema, where)
    if not bounds:
        return None
    low: tuple[int, bool] | None = None  # (bound, exclusive); the tighter wins
    high: tuple[int, bool] | None = None
    for key, bound in bounds:
        if bound != int(bound):
            raise ValueError(f"json_schema: {where}: {key} {bound!r} not supported on a number: "
                             "only whole-number bounds")
        edge = (int(bound), key.startswith("exclusive"))
        if key.endswith("inimum"):
            low = edge if low is None or (edge[0], edge[1]) > low else low
        else:
            high = edge if high is None or (edge[0], not edge[1]) < (high[0], not high[1]) else high
    if low is not None and high is not None and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))):
        raise ValueError(f"json_schema: {where}: no number lies within the bounds")
    parts = []
    if low is None or low[0] < 0:  # v < 0 is -x: x in (max(-high, 0), -low), ends swapped
        x_low = (-high[0], high[1]) if high is not None and high[0] < 0 else (0, True)
        x_high = None if low is None else (-low[0], low[1])
        parts += [f"-(?:{m})" for m in _magnitudes(x_low, x_high)]
    if high is None or high[0] > 0 or (high[0] == 0 and not high[1]):
        parts += _magnitudes(low if low is not None and low[0] >= 0 else (0, False), high)
    return "|".join(parts)


_FRACTION, _NONZERO_FRACTION, _ZERO_FRACTION = r"(\.\d+)?", r"\.\d*[1-9]\d*", r"(\.0+)?"


def _magnitudes(low: tuple[int, bool], high: tuple[int, bool] | None) -> list[str]:
    """Alternatives for the decimals x >= 0 within (low, high), each end (bound, exclusive):
    whole parts strictly inside take any fraction; the ends take what keeps x within."""
    (a, a_open), b = low, high
    out = []
    inner_high = None if b is None else b[0] - 1
    if inner_high is None or a + 1 <= inner_high:
        out.append(f"(?:{integer_range_regex(a + 1, inner_high)}){_FRACTION}")
    if b is not None and b[0] == a:
        return out + ([] if a_open or b[1] else [f"{a}{_ZERO_FRACTION}"])
    out.append(f"{a}{_NONZERO_FRACTION if a_open else _FRACTION}")
    if b is not None and not b[1]:
        out.append(f"{b[0]}{_ZERO_FRACTION}")
    return out


def integer_range_regex(low: int | None, high: int | None) -> str:
    """A regex matching exactly the canonical decimal texts (no leading zeros, no -0) of the
    integers in [low, high]; None: unbounded on that side."""
    parts = []
    if low is None or low < 0:  # the negatives, as - and their magnitudes
        magnitude_low = 1 if high is None or high >= 0 else -high
        magnitude_high = None if low is None else -low
        parts.append("-(?:" + "|".join(_naturals(magnitude_low, magnitude_high)) + ")")
    if high is None or high >= 0:
        parts += _naturals(0 if low is None or low < 0 else low, high)
    return "|".join(parts)


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives for the integers in [low, high] (>= 0; high None: no end), by digit count."""
    out: list[str] = []
    n = len(str(low))
    while True:
        first = low if n == len(str(low)) else 10 ** (n - 1)
        if high is not None and first > high:
            return out
        if high is None and first == 10 ** (n - 1) and n > 1:
            return [*out, rf"[1-9]\d{{{n - 1},}}"]  # every number of n digits or more
        out += _same_length(first, 10 ** n - 1 if high is None else min(high, 10 ** n - 1))
        n += 1
    return out


def _same_length(low: int, high: int) -> list[str]:
    """Alternatives for [low, high], both of the same digit count: runs of aligned blocks
    (fixed leading digits, then free ones), neighbours merged into a digit range."""
    if high < 10:
        return [str(low) if low == high else f"[{low}-{high}]"]
    blocks: list[tuple[str, int, int, int]] = []  # (fixed digits, first digit, last digit, free digits)
    start = low
    while start <= high:
        free = 0
        while start % 10 ** (free + 1) == 0 and start + 10 ** (free + 1) - 1 <= high:
            free += 1
        digits = str(start)
        fixed, digit = digits[: len(digits) - free - 1], int(digits[len(digits) - free - 1])
        if blocks and blocks[-1][0] == fixed and blocks[-1][3] == free and blocks[-1][2] == digit - 1:
            blocks[-1] = (fixed, blocks[-1][1], digit, free)
        else:
            blocks.append((fixed, digit, digit, free))
        start += 10 ** free
    return [fixed + (str(a) if a == b else f"[{a}-{b}]") + (rf"\d{{{free}}}" if free else "")
            for fixed, a, b, free in blocks]


def _search(pattern: Any, where: str) -> str:
    """A JSON Schema pattern (found anywhere in the string) as a whole-text regex."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"json_schema: {where}: pattern must be a non-empty string, got {pattern!r}")
    anchored_start = pattern.startswith("^")
    core = pattern[1:] if anchored_start else pattern
    escapes = len(core[:-1]) - len(core[:-1].rstrip("\\"))  # backslashes before a final $
    anchored_end = core.endswith("$") and escapes % 2 == 0
    if anchored_end:
        core = core[:-1]
    if core:
        try:
            compile_regex(core)  # its own errors, before it is wrapped
        except RegexError as exc:
            reason = str(exc).split(": ", 1)[-1]
            raise ValueError(f"json_schema: {where}: pattern {pattern!r}: {reason}") from None
    any_text = f"{PLAIN_CHAR}*"
    return f"{'' if anchored_start else any_text}(?:{core}){'' if anchored_end else any_text}"
