"""Whether a text is the start of a JSON object: the check behind JSON-constrained generation (`response_format`).

`JsonPrefix` reads characters one at a time through a pushdown automaton (a stack of open objects and arrays,
the state inside the current value) and refuses the first character that no valid JSON text could continue
with; `complete` is true once the top-level object has closed. Strict JSON (RFC 8259): no NaN or Infinity,
no leading zeros, no control characters in strings, no trailing commas. Pure Python, no torch: the sampler
asks it about each candidate token's text (`accepts`), so a state is small and cheap to copy.
"""

from __future__ import annotations

WHITESPACE = " \t\n\r"
# Longest run of whitespace between JSON tokens (a deep indent and its newline): a model that prefers whitespace
# would otherwise pad a constrained reply until max_tokens.
MAX_WHITESPACE = 20
DIGITS = "0123456789"
HEX = "0123456789abcdefABCDEF"
ESCAPES = '"\\/bfnrtu'
LITERALS = {"t": "true", "f": "false", "n": "null"}

# where the automaton stands (between values, or inside one)
VALUE, FIRST_KEY, KEY, COLON, AFTER_MEMBER, FIRST_ITEM, AFTER_ITEM = range(7)
STRING, NUMBER, LITERAL, DONE = range(7, 11)
# inside a number: what was read last
START, MINUS, ZERO, INT, DOT, FRAC, EXP, EXP_SIGN, EXP_DIGITS = range(9)
NUMBER_ENDS = {ZERO, INT, FRAC, EXP_DIGITS}  # a number may stop after these


def _number_moves() -> dict[tuple[int, str], int]:
    """(number state, character) → next number state; anything else ends or breaks the number."""
    moves = {(START, "-"): MINUS, (EXP, "+"): EXP_SIGN, (EXP, "-"): EXP_SIGN}
    for d in DIGITS:
        for before, after in ((START, INT), (MINUS, INT), (INT, INT), (DOT, FRAC), (FRAC, FRAC), (EXP, EXP_DIGITS),
                              (EXP_SIGN, EXP_DIGITS), (EXP_DIGITS, EXP_DIGITS)):
            moves[before, d] = after
    moves[START, "0"] = moves[MINUS, "0"] = ZERO
    for before in (ZERO, INT):
        moves[before, "."] = DOT
    for before in (ZERO, INT, FRAC):
        moves[before, "e"] = moves[before, "E"] = EXP
    return moves


NUMBER_MOVES = _number_moves()


class JsonPrefix:
    __slots__ = ("stack", "state", "key", "escape", "unicode", "number", "literal", "object_root", "spaces")

    def __init__(self, object_root: bool = True) -> None:
        self.object_root = object_root  # the top-level value must be an object (False: any JSON value)
        self.spaces = 0  # whitespace read in a row between tokens
        self.stack: list[str] = []  # "{" or "[" per open container
        self.state = VALUE
        self.key = False  # the string being read is an object key
        self.escape = False  # a backslash was just read in a string
        self.unicode = 0  # hex digits still due in a \\u escape
        self.number = START
        self.literal = ""  # the rest of true/false/null still due

    def copy(self) -> JsonPrefix:
        other = JsonPrefix.__new__(JsonPrefix)
        other.stack, other.state, other.key = list(self.stack), self.state, self.key
        other.escape, other.unicode, other.number, other.literal = self.escape, self.unicode, self.number, self.literal
        other.object_root, other.spaces = self.object_root, self.spaces
        return other

    @property
    def complete(self) -> bool:
        return self.state == DONE

    def accepts(self, text: str) -> bool:
        """Whether `text` would keep this a valid prefix (this state is left as it was)."""
        return self.copy().feed(text)

    def feed(self, text: str) -> bool:
        """Reads `text`; False (the state then undefined) at the first character no JSON object continues with."""
        return all(self._char(c) for c in text)

    def _char(self, c: str) -> bool:
        state = self.state
        if state == STRING:
            return self._string_char(c)
        if state == NUMBER:
            if self._number_char(c):
                return True
            if self.number not in NUMBER_ENDS:
                return False
            self._value_done()  # the number ended here: `c` belongs to what follows it
            return self._char(c)
        if state == LITERAL:
            if not self.literal or c != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._value_done()
            return True
        if c in WHITESPACE:
            self.spaces += 1
            return self.spaces <= MAX_WHITESPACE
        self.spaces = 0
        if state == DONE:
            return False
        if state in (VALUE, FIRST_ITEM):
            if state == FIRST_ITEM and c == "]":
                return self._close("[")
            return self._value_start(c)
        if state in (FIRST_KEY, KEY):
            if state == FIRST_KEY and c == "}":
                return self._close("{")
            if c != '"':
                return False
            self.state, self.key = STRING, True
            return True
        if state == COLON:
            if c != ":":
                return False
            self.state = VALUE
            return True
        if state == AFTER_MEMBER:
            if c == ",":
                self.state = KEY
                return True
            return c == "}" and self._close("{")
        if state == AFTER_ITEM:
            if c == ",":
                self.state = VALUE
                return True
            return c == "]" and self._close("[")
        return False

    def _value_start(self, c: str) -> bool:
        if not self.stack and self.object_root and c != "{":
            return False
        if c == "{":
            self.stack.append("{")
            self.state = FIRST_KEY
        elif c == "[":
            self.stack.append("[")
            self.state = FIRST_ITEM
        elif c == '"':
            self.state, self.key = STRING, False
        elif c == "-" or c in DIGITS:
            self.state, self.number = NUMBER, START
            return self._number_char(c)
        elif c in LITERALS:
            self.state, self.literal = LITERAL, LITERALS[c][1:]
        else:
            return False
        return True

    def _string_char(self, c: str) -> bool:
        if self.unicode:
            if c not in HEX:
                return False
            self.unicode -= 1
        elif self.escape:
            if c not in ESCAPES:
                return False
            self.escape, self.unicode = False, 4 if c == "u" else 0
        elif c == "\\":
            self.escape = True
        elif c == '"':
            if self.key:
                self.state, self.key = COLON, False
            else:
                self._value_done()
        elif ord(c) < 0x20:  # control characters must be escaped
            return False
        return True

    def _number_char(self, c: str) -> bool:
        nxt = NUMBER_MOVES.get((self.number, c))
        if nxt is None:
            return False
        self.number = nxt
        return True

    def _close(self, bracket: str) -> bool:
        if not self.stack or self.stack[-1] != bracket:
            return False
        self.stack.pop()
        self._value_done()
        return True

    def _value_done(self) -> None:
        if not self.stack:
            self.state = DONE
        else:
            self.state = AFTER_MEMBER if self.stack[-1] == "{" else AFTER_ITEM
