"""What the library says about a forward's arguments (docs/design.md §9): each parameter's kind from its
annotation (tensor, optional tensor, list / tuple of tensors, dict of tensors, int, float, bool)
and its shape as the library documents it. transformers and diffusers write the shape in the
forward's docstring, "hidden_states (`torch.Tensor` of shape `(batch_size, sequence_length,
hidden_size)`)", or "with the following shape `(batch, channel, height, width)`": the dims are
names (`batch_size`, `num_channels`, `self.config.caption_channels`) that examples resolves
against the config and the folder's files.
"""

from __future__ import annotations

import dataclasses
import inspect
import re


@dataclasses.dataclass
class Param:
    name: str
    kind: str  # "tensor" | "list" | "dict" | "int" | "float" | "bool" | "other"
    optional: bool  # has a default (None or a value)
    dims: list[str] | None  # the documented shape, dim names as written; None: undocumented
    dtype: str  # "float" | "long" | "bool": from the annotation / documentation
    doc: str  # the parameter's documentation text (one line)
    #: dim names the documentation defines by a formula ("the `hidden_size` is obtained by the following
    #: formula: `hidden_size` = `num_channels` * `patch_size` * `patch_size`": a name the config uses for
    #: another size): {name: the formula}
    formulas: dict = dataclasses.field(default_factory=dict)


def params(model) -> dict[str, Param]:
    """The forward's parameters (not self, *args, **kwargs) with their kinds and documented shapes."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return {}
    docs = documented(inspect.getdoc(model.forward) or "")
    out = {}
    for name, prm in sig.parameters.items():
        if name == "self" or prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD):
            continue
        text = docs.get(name, "")
        annotation = _annotation_text(prm.annotation)
        out[name] = Param(name, _kind(annotation, text), prm.default is not inspect.Parameter.empty,
                          shape_of(text), _dtype(annotation + " " + text.split(")")[0]), text, formulas(text))
    return out


_TERM = r"(?:`?[A-Za-z_]\w*`?|\d+)(?:\s*\*\*\s*\d+)?"
_FORMULA = re.compile(r"`(\w+)`\s*=\s*(" + _TERM + r"(?:\s*[*x+]\s*" + _TERM + r")+)")


def formulas(text: str) -> dict[str, str]:
    """{dim name: formula} the documentation writes as "`name` = `a` * `b` * `c`"."""
    return {m.group(1): m.group(2).replace("`", "") for m in _FORMULA.finditer(text)}


def documented(doc: str) -> dict[str, str]:
    """{parameter: its documentation} from an Args: section (`name (`type` ...): text`, indented
    continuation lines)."""
    out: dict[str, str] = {}
    current, indent = None, 0
    for line in doc.splitlines():
        m = re.match(r"^(\s*)(\w+)\s*:?\s*\(", line)
        stripped = len(line) - len(line.lstrip())
        if m and (current is None or stripped <= indent):
            current, indent = m.group(2), len(m.group(1))
            out.setdefault(current, "")
            out[current] += " " + line.strip()
        elif current is not None and line.strip() and stripped > indent:
            out[current] += " " + line.strip()
        elif current is not None and line.strip() and stripped <= indent:
            current = None
    return {k: v.strip() for k, v in out.items()}


_SHAPE = re.compile(r"shape\s*(?:of\s*)?[`(]*\s*\(([^()]*)\)")


def shape_of(text: str) -> list[str] | None:
    """The first documented shape: "of shape `(batch_size, sequence_length)`" -> ["batch_size",
    "sequence_length"]; None when the text documents none."""
    m = _SHAPE.search(text)
    if not m:
        return None
    dims = [d.strip().strip("`") for d in m.group(1).split(",")]
    dims = [d for d in dims if d]
    if not dims or any(not re.fullmatch(r"[\w. *+/-]+", d) for d in dims):
        return None
    return dims


def _annotation_text(annotation) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    return annotation if isinstance(annotation, str) else str(annotation).replace("typing.", "")


def _kind(annotation: str, doc: str) -> str:
    a = annotation.replace(" ", "")
    head = doc.split(")")[0] if doc else ""
    if re.match(r"^(Optional\[)?(dict|Dict)\[", a) or a.startswith("dict[") or ("dict" in head and "Tensor" in a + head
                                                                              and not a):
        return "dict"
    if re.match(r"^(Optional\[)?(list|List|tuple|Tuple)\[", a) and "Tensor" in a:
        return "list"
    if "Tensor" in a or (not a and "Tensor" in head):
        return "tensor"
    if a.startswith(("int", "Optional[int")) or a.startswith("int|"):
        return "int"
    if a.startswith(("float", "Optional[float")):
        return "float"
    if a.startswith(("bool", "Optional[bool")):
        return "bool"
    return "other"


def _dtype(text: str) -> str:
    if "LongTensor" in text or "IntTensor" in text:
        return "long"
    if "BoolTensor" in text:
        return "bool"
    return "float"
