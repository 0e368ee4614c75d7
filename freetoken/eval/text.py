"""Deterministic filler text of a given token length for generated traces: prose (instructions, descriptions,
chat), code (file contents), listings (search results, directory trees). Built from a seeded RNG over a small
vocabulary: nothing is copied from real sessions, and the same seed always gives the same bytes.

Lengths are in tokens of a typical BPE vocabulary (measured on SmolLM2's: TOKENS_PER_WORD); a server's own count
differs by a few percent, and the replayer reports the server's.
"""

from __future__ import annotations

import random

# Measured with SmolLM2's tokenizer on this module's output (tests/eval/test_shapes.py checks it stays within 15%).
TOKENS_PER_WORD = {"prose": 1.09, "bullets": 1.25, "code": 2.61, "listing": 2.05}

WORDS = """the a to of and in is for that it with as on be by this are or from at an not can you your use when
if each file which will all any only must should before after then than but also more most other into over
under about such these those them their there here new old first last next same every some no yes one two three
tool call result output input user agent model task step plan change edit write read run test build check
command shell path line code function class module package value type error message request response server
client session context history turn token cache memory state config option default setting key field list item
project repository branch commit review diff patch version release issue bug fix feature support behaviour
always never prefer avoid keep make sure return report explain ask answer describe include exclude follow rule
short long clear concise careful exact small large fast slow safe local remote current previous whole part
data text string number name id time date size count limit range start end open close create delete update
search find match pattern query filter sort group select load save send receive wait retry stop continue
work working done pending failed passed running ready empty full valid invalid known unknown simple complex
""".split()

IDENTIFIERS = """config cache buffer parser reader writer handler client server session request response token
state index table entry record batch chunk frame packet stream queue worker task job event signal result
value item node tree graph edge path route layer block page slot expert router model tensor weight shape
""".split()

VERBS = "get set load save build parse read write open close send find check update create remove apply".split()


class TextGen:
    """Seeded filler text; one instance per trace so its output is a function of the seed alone."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def words(self, n: int) -> list[str]:
        return self.rng.choices(WORDS, k=max(1, n))

    def sentence(self, n: int = 0) -> str:
        words = self.words(n or self.rng.randint(8, 22))
        return " ".join(words).capitalize() + "."

    def prose(self, tokens: int, paragraph: int = 90) -> str:
        """About `tokens` tokens of sentences, in paragraphs of about `paragraph` tokens."""
        goal, out, para, used = _words_for(tokens, "prose"), [], [], 0
        while used < goal:
            n = min(self.rng.randint(8, 22), goal - used)
            para.append(self.sentence(max(n, 1)))
            used += max(n, 1)
            if sum(len(s.split()) for s in para) * TOKENS_PER_WORD["prose"] >= paragraph:
                out.append(" ".join(para))
                para = []
        if para:
            out.append(" ".join(para))
        return "\n\n".join(out)

    def bullets(self, tokens: int, heading: str = "") -> str:
        """A markdown section of rules: `# heading` then `- rule` lines."""
        goal, lines, used = _words_for(tokens, "bullets"), [f"# {heading}"] if heading else [], 0
        while used < goal:
            n = min(self.rng.randint(6, 18), goal - used)
            lines.append(f"- {self.sentence(max(n, 1))}")
            used += max(n, 1)
        return "\n".join(lines)

    def ident(self) -> str:
        return f"{self.rng.choice(VERBS)}_{self.rng.choice(IDENTIFIERS)}"

    def path(self, ext: str = "py") -> str:
        parts = self.rng.sample(IDENTIFIERS, self.rng.randint(1, 3))
        return "src/" + "/".join(parts) + f".{ext}"

    def code(self, tokens: int) -> str:
        """About `tokens` tokens of Python-like source, numbered like a file viewer's output."""
        goal, lines, used = _words_for(tokens, "code"), [], 0
        while used < goal:
            name, arg = self.ident(), self.rng.choice(IDENTIFIERS)
            body = [f"def {name}({arg}, {self.rng.choice(IDENTIFIERS)}=None):",
                    f'    """{self.sentence(self.rng.randint(5, 12))}"""',
                    f"    if {arg} is None:",
                    f"        raise ValueError(\"{self.rng.choice(IDENTIFIERS)} is required\")",
                    f"    {self.rng.choice(IDENTIFIERS)} = {self.ident()}({arg}, {self.rng.randint(0, 4096)})",
                    f"    return {self.rng.choice(IDENTIFIERS)}", ""]
            lines += body
            used += 34
        return "\n".join(f"{i:>5}\t{line}" for i, line in enumerate(lines, 1))

    def listing(self, tokens: int) -> str:
        """About `tokens` tokens of `path:line: text` search results."""
        goal, lines, used = _words_for(tokens, "listing"), [], 0
        while used < goal:
            n = self.rng.randint(4, 9)
            lines.append(f"{self.path()}:{self.rng.randint(1, 900)}: {' '.join(self.words(n))}")
            used += n + 3
        return "\n".join(lines)

    def choice(self, seq):
        return self.rng.choice(seq)

    def between(self, low: int, high: int) -> int:
        return self.rng.randint(low, max(low, high))


def _words_for(tokens: int, kind: str) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD[kind]))
