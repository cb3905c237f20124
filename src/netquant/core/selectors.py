"""The one name-pattern language of netquant's selectors, for graph ops and modules alike.

`netquant.passes.OpSelector` (graph PTQ: force_fp32, overrides, `--fp32-ops` on the CLI) and
`netquant.nn.QuantRule` (module API rules) match names with `NamePattern`, so a pattern means the same
in both:

    'name:<n>'    exactly the name n
    'glob:<g>'    fnmatch glob, case-sensitive (`*`, `?`, `[..]`) over the whole name
    're:<regex>'  Python regex, re.search (anywhere in the name; anchor with ^ and $)
    '<g>'         a bare string is a glob ('head' is then the exact name 'head')

A glob ending in '.*' also matches the name before it ('head.*' matches 'head' and 'head.fc'): a
scope and everything inside it.  Types are the other half of a selector and stay native to each
side: an ONNX op type string (`OpSelector(op_type=...)`, 'type:<T>') for graphs, module classes
(`QuantRule(types=...)`, isinstance) for modules.
"""

from __future__ import annotations

import enum
import fnmatch
import re
from dataclasses import dataclass

from netquant.errors import ConfigError


class PatternKind(enum.Enum):
    """How a NamePattern compares names."""

    EXACT = "name"
    GLOB = "glob"
    REGEX = "re"


_PREFIXES = {f"{kind.value}:": kind for kind in PatternKind}


@dataclass(frozen=True)
class NamePattern:
    """A compiled name pattern (see the module docstring); `parse` reads the text form."""

    kind: PatternKind
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ConfigError(f"a name pattern must be a string, got {type(self.text).__name__}")
        if self.kind is PatternKind.REGEX:
            try:
                re.compile(self.text)
            except re.error as err:
                raise ConfigError(f"invalid regex in name pattern 're:{self.text}': {err}") from None

    @classmethod
    def parse(cls, text: str) -> NamePattern:
        """'name:', 'glob:' or 're:' prefixed text, or a bare glob."""
        if not isinstance(text, str):
            raise ConfigError(f"a name pattern must be a string, got {text!r}")
        for prefix, kind in _PREFIXES.items():
            if text.startswith(prefix):
                return cls(kind, text[len(prefix):])
        return cls(PatternKind.GLOB, text)

    @property
    def is_wildcard(self) -> bool:
        """Whether it can match more than one name."""
        return self.kind is PatternKind.REGEX or (self.kind is PatternKind.GLOB and has_glob_chars(self.text))

    def matches(self, name: str) -> bool:
        if self.kind is PatternKind.EXACT:
            return name == self.text
        if self.kind is PatternKind.REGEX:
            return re.search(self.text, name) is not None
        if fnmatch.fnmatchcase(name, self.text):
            return True
        return self.text.endswith(".*") and name == self.text[:-2]

    def __str__(self) -> str:
        return self.text if self.kind is PatternKind.GLOB else f"{self.kind.value}:{self.text}"


def has_glob_chars(text: str) -> bool:
    """Whether `text` holds a glob wildcard (`*`, `?` or `[`)."""
    return any(ch in text for ch in "*?[")
