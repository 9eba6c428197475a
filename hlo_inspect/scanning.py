"""Text primitives for reading HLO: the parse error, brackets, strings, comments and C escapes.

Everything here works on one piece of text (an instruction, a shape, a header) and is linear in its length.
"""

from __future__ import annotations

import re

__all__ = ["HloParseError", "match_close", "string_end", "split_top_level", "unquote", "unescape",
           "strip_comments", "int_list"]


class HloParseError(ValueError):
    """Text that is not HLO as XLA prints it. `line_no` is 1-based; `line` the offending text.

    `unclosed` marks errors about a bracket or string that the text ends inside of: the parser then tries
    the instruction again joined with the lines that follow (an instruction printed over several lines).
    """

    def __init__(self, message: str, line_no: int | None = None, line: str | None = None, *,
                 unclosed: bool = False):
        self.message, self.line_no, self.line, self.unclosed = message, line_no, line, unclosed
        where = f"line {line_no}: " if line_no is not None else ""
        shown = ""
        if line is not None:
            text = line.strip()
            shown = "\n    " + (text if len(text) <= 200 else text[:200] + " ...")
        super().__init__(f"{where}{message}{shown}")


BRACKETS = {"(": ")", "{": "}", "[": "]"}
_SPECIAL_RE = re.compile(r'[(){}\[\],"]')
_BRACKET_OR_QUOTE_RE = re.compile(r'[(){}\[\]"]')
_STRING_BODY_RE = re.compile(r'(?:[^"\\]++|\\.)*+"', re.DOTALL)
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def string_end(text: str, start: int, line_no: int | None = None, line: str | None = None) -> int:
    """Index just past the string that opens with the quote at text[start] (backslash escapes skipped)."""
    m = _STRING_BODY_RE.match(text, start + 1)
    if m is None:
        raise HloParseError(f"the string opened at column {start + 1} is never closed (truncated text?)",
                            line_no, line if line is not None else text, unclosed=True)
    return m.end()


def match_close(text: str, start: int, line_no: int | None = None, line: str | None = None) -> int:
    """Index just past the bracket that closes text[start] (an opening bracket), skipping strings."""
    stack = [BRACKETS[text[start]]]
    pos = start + 1
    search = _BRACKET_OR_QUOTE_RE.search
    while True:
        m = search(text, pos)
        if m is None:
            raise HloParseError(f"'{text[start]}' opened at column {start + 1} is never closed: expected "
                                f"'{stack[-1]}' (truncated text?)", line_no, line if line is not None else text,
                                unclosed=True)
        ch = m.group()
        pos = m.end()
        if ch == '"':
            pos = string_end(text, m.start(), line_no, line)
        elif ch in BRACKETS:
            stack.append(BRACKETS[ch])
        else:
            if ch != stack[-1]:
                raise HloParseError(f"unbalanced '{ch}' at column {m.start() + 1}: expected '{stack[-1]}'",
                                    line_no, line if line is not None else text)
            stack.pop()
            if not stack:
                return pos


def split_top_level(text: str, line_no: int | None = None, line: str | None = None, *,
                    keep_empty: bool = False) -> list[str]:
    """Split on commas outside brackets and strings; parts stripped, empty parts dropped unless `keep_empty`."""
    parts, start, pos = [], 0, 0
    search = _SPECIAL_RE.search
    while True:
        m = search(text, pos)
        if m is None:
            break
        ch = m.group()
        if ch == ",":
            parts.append(text[start:m.start()])
            start = pos = m.end()
        elif ch == '"':
            pos = string_end(text, m.start(), line_no, line)
        elif ch in BRACKETS:
            pos = match_close(text, m.start(), line_no, line)
        else:
            raise HloParseError(f"unbalanced '{ch}' at column {m.start() + 1}", line_no,
                                line if line is not None else text)
    parts.append(text[start:])
    return [p.strip() for p in parts if keep_empty or p.strip()]


_ESCAPE_RE = re.compile(r"\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|(.))", re.DOTALL)
_SIMPLE_ESCAPES = {"n": b"\n", "t": b"\t", "r": b"\r", "a": b"\a", "b": b"\b", "f": b"\f", "v": b"\v"}


def unescape(body: str) -> str:
    """Undo the C escapes XLA's printer writes in strings (`absl::CEscape`): `\\303\\251` -> 'é' (the octal
    escapes are UTF-8 bytes), `\\"` -> '"', `\\n` -> newline. Bytes that are not UTF-8 become U+FFFD."""
    if "\\" not in body:
        return body
    out = bytearray()
    pos = 0
    for m in _ESCAPE_RE.finditer(body):
        out += body[pos:m.start()].encode("utf-8", "surrogatepass")
        octal, hexa, other = m.groups()
        if octal is not None:
            out.append(int(octal, 8) & 0xFF)
        elif hexa is not None:
            out.append(int(hexa, 16))
        else:
            out += _SIMPLE_ESCAPES.get(other, other.encode("utf-8", "surrogatepass"))
        pos = m.end()
    out += body[pos:].encode("utf-8", "surrogatepass")
    return out.decode("utf-8", "replace")


def unquote(value: str) -> str:
    """`"caf\\303\\251"` -> 'café'; text without surrounding quotes is returned stripped."""
    value = value.strip()
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        return unescape(value[1:-1])
    return value


def strip_comments(text: str) -> str:
    """Drop `/* ... */` comments (the printer's `/*index=5*/` in long operand lists and tuple shapes)."""
    return _COMMENT_RE.sub("", text) if "/*" in text else text


_INT_RE = re.compile(r"-?\d+")


def int_list(text: str) -> tuple[int, ...]:
    """Every integer in `text`: `{1,0}` -> (1, 0)."""
    return tuple(int(x) for x in _INT_RE.findall(text))
